"""What a machine's CPUs are worth to the tasks that will run there: which CPUs are hyperthread
siblings of one core, and the CPU quota of the cgroup this process (and so the tasks it or its
agent starts) runs in. The launcher's CPU split (launcher/plan/cpu_fit.py) gives `cpus: auto`
tasks physical cores first, siblings last, and no more CPUs than the quota pays for: a container
limited to 4 CPUs of 64 that pinned two tasks to 32 CPUs each would have TensorFlow run 64
threads on 4 CPUs' worth of time.

Read where the tasks run: by the launcher for this machine, by the preflight probe on an SSH host
or Slurm node. The readers take their roots as arguments so that a scripted tree (a folder a test
wrote) is read exactly like /sys and /proc. Nothing found is an empty list or None, never an
error. Standard library only (and worker/topology.py's CPU-list parser).
"""

from __future__ import annotations

import os

from distlaunch.worker.topology import parse_cpulist

SYS = "/sys"
PROC = "/proc"
CGROUP = "/sys/fs/cgroup"


def siblings(sys_root: str = SYS) -> list[list[int]]:
    """The CPUs of each core that has more than one (hyperthread siblings), from every CPU's
    ``topology/thread_siblings_list``, by their lowest id; [] where none is known or no core has
    two threads."""
    base = os.path.join(sys_root, "devices", "system", "cpu")
    try:
        names = [n for n in os.listdir(base) if n.startswith("cpu") and n[3:].isdigit()]
    except OSError:
        return []
    groups = set()
    for name in names:
        try:
            with open(os.path.join(base, name, "topology", "thread_siblings_list")) as f:
                groups.add(tuple(parse_cpulist(f.read())))
        except (OSError, ValueError):
            continue
    return sorted(list(g) for g in groups if len(g) > 1)


def quota(proc_root: str = PROC, cgroup_root: str = CGROUP) -> float | None:
    """The CPUs' worth of time (quota over period) the tightest CPU limit on this process's
    cgroup or any cgroup above it allows: cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us``; None where there is no limit or none can be read."""
    try:
        with open(os.path.join(proc_root, "self", "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if number == "0" and controllers == "":
            found += _limits(os.path.join(cgroup_root, "unified"), path, _v2)
            found += _limits(cgroup_root, path, _v2)
        elif "cpu" in controllers.split(","):
            for mount in (controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu"):
                found += _limits(os.path.join(cgroup_root, mount), path, _v1)
    return min(found, default=None)


def read(sys_root: str = SYS, proc_root: str = PROC, cgroup_root: str = CGROUP) -> dict:
    """`siblings` and `quota` as JSON data: ``{"siblings": [[0, 4], ...], "quota": 2.5}``."""
    return {"siblings": siblings(sys_root), "quota": quota(proc_root, cgroup_root)}


def _limits(mount: str, path: str, limit) -> list[float]:
    """The limit of the cgroup at ``path`` under ``mount`` and of each one above it: a limit
    set on a parent binds its children too (a container's own root shows as ``/``)."""
    if not os.path.isdir(mount):
        return []
    out = []
    parts = [p for p in path.strip().split("/") if p]
    for depth in range(len(parts), -1, -1):
        found = limit(os.path.join(mount, *parts[:depth]))
        if found is not None:
            out.append(found)
    return out


def _v2(folder: str) -> float | None:
    """``cpu.max``: ``QUOTA PERIOD`` (``max`` for none)."""
    try:
        with open(os.path.join(folder, "cpu.max")) as f:
            quota_us, _, period_us = f.read().strip().partition(" ")
        if quota_us == "max":
            return None
        return int(quota_us) / int(period_us or 100000)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _v1(folder: str) -> float | None:
    """``cpu.cfs_quota_us`` (-1 for none) over ``cpu.cfs_period_us``."""
    try:
        with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
            quota_us = int(f.read().strip())
        with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
            period_us = int(f.read().strip())
        return quota_us / period_us if quota_us > 0 else None
    except (OSError, ValueError, ZeroDivisionError):
        return None
