"""What CPUs a machine gives this process, its NUMA nodes, and each NVIDIA GPU's NUMA node.

Read where tasks will run: by the launcher for this machine, by the preflight probe on an SSH
host or Slurm node (standard library only: the probe imports it where distlaunch is installed).
The launcher's plan splits these CPUs between the tasks of the machine (launcher/plan/cpu_fit.py).

The readers take the sysfs root as an argument so that scripted topologies (a folder written by a
test) are read exactly like /sys. Nothing found (no NUMA in the kernel, no GPU) is an empty list,
never an error: the split then treats the machine as one node.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

SYS = "/sys"
NVIDIA_VENDOR = "0x10de"
# PCI class 0x03xxxx: display controllers (VGA 0x0300, 3D 0x0302): NVIDIA's GPUs, not its audio
# or USB functions on the same card.
DISPLAY_CLASS = "0x03"


def parse_cpulist(text: str) -> list[int]:
    """The CPU ids of a kernel CPU list such as ``0-3,8,10-11`` (empty: none)."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        out.extend(range(int(first), int(last or first) + 1))
    return out


def numa_nodes(sys_root: str = SYS) -> list[list[int]]:
    """Each NUMA node's CPUs, by node number (a gap in the numbering is an empty node); [] where
    the kernel shows no node."""
    base = os.path.join(sys_root, "devices", "system", "node")
    try:
        names = [n for n in os.listdir(base) if n.startswith("node") and n[4:].isdigit()]
    except OSError:
        return []
    nodes: list[list[int]] = [[] for _ in range(max((int(n[4:]) for n in names), default=-1) + 1)]
    for name in names:
        try:
            with open(os.path.join(base, name, "cpulist"), encoding="ascii") as f:
                nodes[int(name[4:])] = parse_cpulist(f.read())
        except (OSError, ValueError):
            continue
    return nodes


def gpu_numa_of(devices: Iterable[tuple[str, str, str, str]]) -> list[int]:
    """The NUMA node of each NVIDIA GPU, in CUDA's PCI bus order (GPU index 0 first), from
    ``(bus_id, vendor, class, numa_node)`` of every PCI device; -1 where the kernel does not know
    (a machine without NUMA writes -1)."""
    gpus = sorted(
        (bus, node)
        for bus, vendor, klass, node in devices
        if vendor.strip() == NVIDIA_VENDOR and klass.strip().startswith(DISPLAY_CLASS)
    )
    out = []
    for _, node in gpus:
        try:
            out.append(max(int(node), -1))
        except ValueError:
            out.append(-1)
    return out


def gpu_numa_nodes(sys_root: str = SYS) -> list[int]:
    """`gpu_numa_of` over /sys/bus/pci/devices/*/{vendor,class,numa_node}."""
    base = os.path.join(sys_root, "bus", "pci", "devices")
    try:
        buses = sorted(os.listdir(base))
    except OSError:
        return []
    devices = []
    for bus in buses:
        values = []
        for key in ("vendor", "class", "numa_node"):
            try:
                with open(os.path.join(base, bus, key), encoding="ascii") as f:
                    values.append(f.read())
            except OSError:
                values.append("-1" if key == "numa_node" else "")
        devices.append((bus, values[0], values[1], values[2]))
    return gpu_numa_of(devices)


def read(sys_root: str = SYS) -> dict:
    """This process's CPUs (its affinity mask), the NUMA nodes and the GPUs' nodes, as JSON data:
    ``{"cpus": [...], "numa": [[...], ...], "gpu_numa": [...]}``."""
    return {
        "cpus": sorted(os.sched_getaffinity(0)),
        "numa": numa_nodes(sys_root),
        "gpu_numa": gpu_numa_nodes(sys_root),
    }
