"""Which CPUs each task of one machine gets: the spec's `cpus` against what the machine gives.

TensorFlow sizes its thread pools to the CPUs a process may run on (its affinity mask), so N tasks
on one M-CPU machine run N x M busy threads; pinned to CPUs of their own, co-located workers train
faster (bench/cpu_placement.py). The rules, in order:

- a list of CPU ids is the user's: kept as written (two tasks may share a CPU only so), each id
  one the machine gives the run;
- a count takes that many of the CPUs no list took and no other count took;
- ``"auto"`` tasks split what is left evenly (sizes differ by at most one); a task alone keeps
  everything left; more ``auto`` tasks than CPUs left share those CPUs (said by `up`). Where
  cores have hyperthread siblings, ``auto`` tasks split the physical cores (one CPU of each),
  siblings only when the tasks outnumber the cores; and they take no more CPUs than the CPU
  quota of the tasks' cgroup pays for (at least one each);
- every pick takes physical cores first, hyperthread siblings last;
- ``"all"`` is not pinned (TensorFlow's own behaviour);
- NUMA: a task with GPUs is placed on its first GPU's node where its CPUs fit there; any task's
  CPUs come from one node where they fit (the fullest node that fits, to keep large blocks whole).

Where the machine picks the CPU ids itself (Slurm: `--cpus-per-task`), only the counts are
decided. Where the machine is not known yet (a dry run's SSH host) lists stay as written and the
rest is left to `up`. Errors are `CpuMisfit`, naming the task: the caller turns it into the
spec error of that task's `cpus`.

Pure: the machine's CPUs come in as a `Topology`; nothing here reads the machine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

TaskKey = tuple[str, int]  # (role, index)
# The environment TensorFlow (and OpenMP in its kernels) reads for its thread pools.
THREAD_ENV = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "OMP_NUM_THREADS")


class CpuHow(StrEnum):
    """How a task's CPUs were decided (what `plan` shows beside them)."""

    AUTO = "auto"
    ALL = "all"
    COUNT = "count"
    LISTED = "listed"


@dataclass(frozen=True)
class TaskCpus:
    """One task's CPUs: ``ids`` it is pinned to (empty where the machine picks them or they are
    not known yet), ``count`` of them (0: not pinned, every CPU the machine gives)."""

    how: CpuHow
    ids: tuple[int, ...] = ()
    count: int = 0
    shared: bool = False  # ``auto`` tasks that outnumber the CPUs left, sharing them

    @property
    def pinned(self) -> bool:
        """Whether the task runs on a set of CPUs of its own size (its threads follow it)."""
        return self.count > 0

    def to_json(self) -> dict:
        """The CPUs as `plan --json` shows them."""
        return {
            "how": str(self.how),
            "ids": list(self.ids),
            "count": self.count,
            "shared": self.shared,
        }

    @classmethod
    def from_json(cls, data: Mapping) -> TaskCpus:
        """Read `to_json`'s data back."""
        return cls(
            CpuHow(data["how"]),
            tuple(data.get("ids", ())),
            int(data.get("count", 0)),
            bool(data.get("shared", False)),
        )


UNPINNED = TaskCpus(CpuHow.ALL)


@dataclass(frozen=True)
class Topology:
    """The CPUs one machine gives the run (its affinity mask, ascending), its NUMA nodes' CPUs
    (by node number; empty: one node) and each GPU index's NUMA node (-1: unknown).
    ``picks_ids``: the machine chooses which CPUs (Slurm); only counts are decided.
    ``siblings``: the CPUs of each core with more than one (hyperthreads; empty: none known);
    ``quota``: the CPUs' worth of time the tasks' cgroup allows (None: no limit)."""

    cpus: tuple[int, ...]
    nodes: tuple[tuple[int, ...], ...] = ()
    gpu_nodes: tuple[int, ...] = ()
    picks_ids: bool = False
    siblings: tuple[tuple[int, ...], ...] = ()
    quota: float | None = None

    @classmethod
    def from_json(cls, data: Mapping) -> Topology:
        """From worker/topology.py's ``read()`` data, with host/cpu_facts.py's ``read()``."""
        quota = data.get("quota")
        return cls(
            tuple(sorted(data["cpus"])),
            tuple(tuple(n) for n in data.get("numa", ())),
            tuple(data.get("gpu_numa", ())),
            siblings=tuple(tuple(g) for g in data.get("siblings") or ()),
            quota=float(quota) if isinstance(quota, (int, float)) and quota > 0 else None,
        )

    def cores_first(self, cpus: Sequence[int]) -> list[int]:
        """``cpus`` with one CPU of each core whose threads are all among them first, then the
        rest (hyperthread siblings, and the threads of cores partly taken), each part ascending:
        tasks get physical cores before any sibling. As given where no siblings are known."""
        if not self.siblings:
            return list(cpus)
        have = set(cpus)
        first = {min(g) for g in self.siblings if set(g) <= have}
        first |= have - {c for g in self.siblings for c in g}  # a CPU with no sibling known
        return sorted(first) + sorted(have - first)

    def physical(self, cpus: Sequence[int]) -> int:
        """How many of ``cpus`` come first in `cores_first` (each a core of its own)."""
        if not self.siblings:
            return len(cpus)
        have = set(cpus)
        siblings = {c for g in self.siblings for c in g}
        return sum(set(g) <= have for g in self.siblings) + len(have - siblings)

    def node_of(self, cpu: int) -> int:
        """The NUMA node of ``cpu`` (0 where none is known)."""
        return next((i for i, node in enumerate(self.nodes) if cpu in node), 0)


@dataclass(frozen=True)
class Ask:
    """One task of the machine: its key, its spec `cpus` and its GPU indices."""

    key: TaskKey
    want: int | tuple[int, ...] | str
    gpus: tuple[int, ...] = ()


class CpuMisfit(ValueError):
    """The CPUs asked of one machine do not fit it; ``key`` names the task whose `cpus` is wrong."""

    def __init__(self, key: TaskKey, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.message = message


def split(machine: str, asks: Sequence[Ask], topo: Topology | None) -> dict[TaskKey, TaskCpus]:
    """Each task's CPUs on ``machine`` (``topo``: what it gives the run; None: not known yet).

    Raises CpuMisfit for a CPU id the machine does not give, a count past its CPUs, or counts and
    lists that leave a count or an ``auto`` task no CPU of its own.
    """
    out = {a.key: UNPINNED for a in asks if a.want == "all"}
    listed = {a.key: a.want for a in asks if isinstance(a.want, tuple)}
    counted = [(a, a.want) for a in asks if isinstance(a.want, int)]
    autos = [a for a in asks if a.want == "auto"]
    out.update({key: TaskCpus(CpuHow.LISTED, ids, len(ids)) for key, ids in listed.items()})
    if topo is None:
        out.update({a.key: TaskCpus(CpuHow.COUNT, (), n) for a, n in counted})
        out.update({a.key: TaskCpus(CpuHow.AUTO) for a in autos})
        return out
    have = set(topo.cpus)
    for key, ids in listed.items():
        missing = [c for c in ids if c not in have]
        if missing:
            raise CpuMisfit(
                key,
                f"gives {_name(key)} CPU {missing[0]}, but {machine} gives the run CPUs "
                f"{cpulist(topo.cpus)}",
            )
    for ask, n in counted:
        if n > len(topo.cpus):
            raise CpuMisfit(
                ask.key,
                f"asks for {n} CPUs for {_name(ask.key)}, but {machine} gives the run "
                f"{cpus_word(len(topo.cpus))}",
            )
    taken = {c for ids in listed.values() for c in ids}
    free = topo.cores_first([c for c in topo.cpus if c not in taken])
    sizes = {a.key: n for a, n in counted}
    left = len(free) - sum(sizes.values())
    if left < 0 or (autos and left == 0):
        first = autos[0] if left == 0 else _first_past(counted, len(free))
        raise CpuMisfit(
            first.key,
            f"leaves {_name(first.key)} no CPU of its own: {machine} gives the run "
            f"{cpus_word(len(topo.cpus))}, {len(taken)} listed, {sum(sizes.values())} counted; tasks "
            'never share a CPU unless listed so (expected fewer CPUs asked, or "all")',
        )
    shared = len(autos) > left
    if not shared:
        budget = _auto_budget(topo, free, len(taken) + sum(sizes.values()), left, len(autos))
        each, extra = divmod(budget, len(autos)) if autos else (0, 0)
        sizes.update({a.key: each + (i < extra) for i, a in enumerate(autos)})
    asked = [a for a, _ in counted] + [a for a in autos if a.key in sizes]
    picked = _pick(free, asked, sizes, topo)
    rest = tuple(sorted(set(free) - {c for ids in picked.values() for c in ids}))
    for ask, _ in counted:
        out[ask.key] = _decided(CpuHow.COUNT, picked[ask.key], topo)
    for ask in autos:
        if shared:
            out[ask.key] = TaskCpus(CpuHow.AUTO, () if topo.picks_ids else rest, len(rest), True)
        else:
            out[ask.key] = _decided(CpuHow.AUTO, picked[ask.key], topo)
    return out


def _auto_budget(topo: Topology, free: list[int], used: int, left: int, autos: int) -> int:
    """How many CPUs the ``autos`` tasks split (``left`` of ``free`` are theirs, ``used`` are
    listed or counted): the physical cores left, where they are at least one per task (siblings
    only when the tasks outnumber the cores), and no more than the cgroup's quota pays for, less
    what is used (at least one each: a task pinned to a CPU of its own beats sharing)."""
    cores = topo.physical(free) - (len(free) - left)
    budget = cores if cores >= autos else left
    if topo.quota is not None:
        budget = min(budget, max(math.floor(topo.quota) - used, autos))
    return budget


def _first_past(counted: list[tuple[Ask, int]], free: int) -> Ask:
    """The first counted task whose CPUs, with those counted before it, pass ``free``."""
    total = 0
    for ask, n in counted:
        total += n
        if total > free:
            return ask
    return counted[-1][0]


def _decided(how: CpuHow, ids: tuple[int, ...], topo: Topology) -> TaskCpus:
    return TaskCpus(how, () if topo.picks_ids else ids, len(ids))


def _pick(
    free: list[int], asks: list[Ask], sizes: Mapping[TaskKey, int], topo: Topology
) -> dict[TaskKey, tuple[int, ...]]:
    """Disjoint CPUs of ``free`` for ``asks`` (``sizes`` of them each), NUMA-aware: tasks with
    GPUs first, on their GPU's node; then the largest first, each on one node where it fits."""

    def gpu_node(ask: Ask) -> int:
        first = ask.gpus[0] if ask.gpus else -1
        return topo.gpu_nodes[first] if 0 <= first < len(topo.gpu_nodes) else -1

    order = sorted(asks, key=lambda a: (gpu_node(a) < 0, -sizes[a.key]))
    left = list(free)
    out = {}
    for ask in order:
        ids = _take(left, sizes[ask.key], gpu_node(ask), topo)
        out[ask.key] = ids
        left = [c for c in left if c not in ids]
    return out


def _take(free: list[int], size: int, prefer: int, topo: Topology) -> tuple[int, ...]:
    """``size`` CPUs of ``free``: from node ``prefer`` where they fit there, else from the
    fullest node they fit in whole (lowest number first), else across nodes, fullest first."""
    by_node: dict[int, list[int]] = {}
    for cpu in free:
        by_node.setdefault(topo.node_of(cpu), []).append(cpu)
    if len(by_node.get(prefer, ())) >= size:
        return tuple(sorted(by_node[prefer][:size]))
    fits = [n for n, cpus in by_node.items() if len(cpus) >= size]
    if fits:
        best = min(fits, key=lambda n: (len(by_node[n]), n))
        return tuple(sorted(by_node[best][:size]))
    order = sorted(by_node, key=lambda n: (n != prefer, -len(by_node[n]), n))
    spread = [c for n in order for c in by_node[n]]
    return tuple(sorted(spread[:size]))


# TensorFlow's inter-op pool never smaller than this: with one inter-op thread a blocking op
# (a parameter server's or worker's Recv, a dataset's prefetch) holds the only thread and the
# cluster deadlocks (a PSS worker and ps pinned to one CPU each never served a step).
MIN_INTEROP_THREADS = 2


def threads(cpus: TaskCpus) -> dict[str, int] | None:
    """The size of each TensorFlow thread pool (and OpenMP's) for a task with ``cpus``, by
    variable (THREAD_ENV): the intra-op pool and OpenMP's sized to its CPUs, written out so that
    a process whose mask is wider (a container with a CPU quota) sizes its pools the same; the
    inter-op pool at least MIN_INTEROP_THREADS; None when not pinned."""
    if not cpus.pinned:
        return None
    intra, inter, omp = THREAD_ENV
    return {intra: cpus.count, inter: max(cpus.count, MIN_INTEROP_THREADS), omp: cpus.count}


def cpulist(cpus: Sequence[int]) -> str:
    """``cpus`` as the kernel writes a CPU list: ``0-3,8``."""
    out: list[str] = []
    ordered = sorted(cpus)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def _name(key: TaskKey) -> str:
    return f"{key[0]}:{key[1]}"


def cpus_word(n: int) -> str:
    """``n CPUs`` (``1 CPU``)."""
    return f"{n} CPU" if n == 1 else f"{n} CPUs"
