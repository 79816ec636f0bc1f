"""This machine's CPUs as the CPU split sees them (`plan.cpu_fit.Topology`): the launcher's own
affinity mask (what it may give its tasks: a `taskset` or a cgroup around it narrows it), the
NUMA nodes, its cores' hyperthread siblings and its cgroup's CPU quota (host/cpu_facts.py), and the NUMA node of each GPU a local task may be given (its index counts within the
launcher's CUDA_VISIBLE_DEVICES, as plan._cuda_visible does).
"""

from __future__ import annotations

from dataclasses import replace

from distlaunch.host import cpu_facts
from distlaunch.launcher.plan.cpu_fit import Topology
from distlaunch.worker import topology


def this_machine(visible: str | None) -> Topology:
    """What this machine gives the run; ``visible`` is the launcher's CUDA_VISIBLE_DEVICES."""
    found = Topology.from_json({**topology.read(), **cpu_facts.read()})
    return replace(found, gpu_nodes=seen_through(found.gpu_nodes, visible))


def seen_through(gpu_nodes: tuple[int, ...], visible: str | None) -> tuple[int, ...]:
    """The NUMA node of each GPU index a local task may name: the physical GPUs in
    ``visible``'s order (an entry that is no index, a UUID, has no known node: -1)."""
    if visible is None:
        return gpu_nodes
    out = []
    for entry in (g.strip() for g in visible.split(",") if g.strip()):
        physical = int(entry) if entry.isdigit() else -1
        out.append(gpu_nodes[physical] if 0 <= physical < len(gpu_nodes) else -1)
    return tuple(out)
