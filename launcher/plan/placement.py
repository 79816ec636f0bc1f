"""Placement: where every task of a plan runs, decided once per backend and then only read.

One row per task (`Placement`): the machine it is on, the address TF_CONFIG names, its port, its
GPUs, its CPUs, the transport that starts it, its interpreter and its working dir. Each backend builds its
table with one function here: `on_hosts` (this machine and SSH hosts, as the spec places the
tasks), `in_containers` (the same tasks, each in a container: compose, Kubernetes), `on_nodes`
(Slurm, once the allocation's nodes are known). Ports, isolation, the plan and the backends'
checks read the rows: nothing after these functions asks the spec where a task runs. The CPUs
come last (`with_cpus`), once the backend knows what its machines give the run.

Pure: nothing here touches the machine.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from distlaunch.launcher.core.backends import TaskTransport
from distlaunch.launcher.core.errors import SpecError
from distlaunch.launcher.plan import cpu_fit
from distlaunch.launcher.plan.cpu_fit import UNPINNED, TaskCpus, Topology
from distlaunch.launcher.spec.model import Gpus, LoadedSpec, TaskEntry, task_json_path

TaskKey = tuple[str, int]  # (role, index)

# The interpreter of a task in a container of the distlaunch image: docker/Dockerfile puts the
# image's venv first on PATH. The launcher's own interpreter path means nothing in there.
IMAGE_PYTHON = "python"
# The CPU split's name for this machine: every task the local transport starts runs on it,
# whatever address its host has in the spec.
THIS_MACHINE = "localhost"


@dataclass(frozen=True)
class Placement:
    """Where one task runs: one row of a plan's placement table."""

    role: str
    index: int
    host_name: str  # the host as the spec names it (under Slurm: the node)
    machine: str  # the machine whose GPUs the task's indices count on
    address: str  # what TF_CONFIG names: an address, a node, a service or pod name
    port: int | None  # None: `auto`, until ports.allocate picks it
    gpus: tuple[int, ...]  # the GPU indices on ``machine``; () for CPU only
    transport: TaskTransport
    python: str  # the interpreter that runs the task there
    cwd: str  # "" on an SSH host without a workdir: where ssh logs in
    cpus: TaskCpus = UNPINNED  # decided by `with_cpus`

    @property
    def key(self) -> TaskKey:
        """``(role, index)``, as ports are keyed."""
        return (self.role, self.index)

    @property
    def cpu_machine(self) -> str:
        """The machine whose CPUs the task's count on: localhost for every task started here."""
        return THIS_MACHINE if self.transport == TaskTransport.LOCAL else self.machine

    @property
    def known_port(self) -> int:
        """The task's port; ValueError while an `auto` port is still to be picked."""
        if self.port is None:
            raise ValueError(f"{self.role}:{self.index} has no port yet (ports.allocate picks it)")
        return self.port


@dataclass(frozen=True)
class Placements:
    """A plan's placement table: one row per task, roles in TF_CONFIG order, then by index."""

    rows: tuple[Placement, ...]

    def with_ports(self, ports: Mapping[TaskKey, int]) -> Placements:
        """The same table with each task of ``ports`` at that port (the others keep theirs)."""
        return Placements(tuple(replace(r, port=ports.get(r.key, r.port)) for r in self.rows))

    def by_role(self) -> dict[str, list[Placement]]:
        """The rows of each role, in TF_CONFIG order."""
        out: dict[str, list[Placement]] = {}
        for row in self.rows:
            out.setdefault(row.role, []).append(row)
        return out

    def addresses(self) -> dict[str, list[str]]:
        """Every role's ``address:port`` list, as TF_CONFIG's cluster names them; ValueError
        while a port is still to be picked."""
        return {
            role: [f"{row.address}:{row.known_port}" for row in rows]
            for role, rows in self.by_role().items()
        }


def with_cpus(
    loaded: LoadedSpec, placed: Placements, topos: Mapping[str, Topology | None]
) -> Placements:
    """``placed`` with each task's CPUs (`plan.cpu_fit.split`), per machine (``Placement.cpu_machine``);
    ``topos``: what each machine gives the run (missing or None: not known yet). Raises
    SpecError naming the task's `cpus` when they do not fit its machine."""
    wants = {(role, index): entry.cpus for role, index, entry in _entries(loaded)}
    machines: dict[str, list[Placement]] = {}
    for row in placed.rows:
        machines.setdefault(row.cpu_machine, []).append(row)
    decided: dict[TaskKey, TaskCpus] = {}
    for machine, rows in machines.items():
        asks = [cpu_fit.Ask(r.key, wants[r.key], r.gpus) for r in rows]
        name = rows[0].host_name if machine != THIS_MACHINE else THIS_MACHINE
        try:
            decided.update(cpu_fit.split(name, asks, topos.get(machine)))
        except cpu_fit.CpuMisfit as exc:
            where = task_json_path(loaded.raw, exc.key[0], exc.key[1], "cpus")
            raise SpecError(loaded.shown, where, exc.message) from None
    return Placements(tuple(replace(r, cpus=decided[r.key]) for r in placed.rows))


def on_hosts(loaded: LoadedSpec) -> Placements:
    """The local backend's table: each task on this machine or on the SSH host its `host` names.

    A local task runs program.python (else this launcher's interpreter) in the spec's workdir;
    an SSH task runs its host's python in its host's workdir. Fixed ports are as written.
    """
    rows = []
    wanted = []
    for role, index, entry in _entries(loaded):
        ssh = loaded.ssh_host(entry.host)
        address = loaded.address_of(entry.host)
        rows.append(
            Placement(
                role=role,
                index=index,
                host_name=entry.host,
                machine=address,
                address=address,
                port=_fixed_port(entry),
                gpus=(),
                transport=TaskTransport.LOCAL if ssh is None else TaskTransport.SSH,
                python=launcher_python(loaded) if ssh is None else ssh.python,
                cwd=str(loaded.workdir) if ssh is None else ssh.workdir or "",
            )
        )
        wanted.append(entry.gpus)
    return _with_gpus(rows, wanted)


def in_containers(
    where: Placements, port: int, transport: TaskTransport, address: Callable[[str, int], str]
) -> Placements:
    """The tasks of ``where`` (an `on_hosts` table) each in a container of its own: reached at
    ``address(role, index)`` on ``port`` (every container has its own network), running the
    image's python in the same working dir (the containers mount it at its path).

    The GPUs stay as ``where`` counted them: the number is what a container asks for.
    """
    return Placements(
        tuple(
            replace(
                row,
                address=address(row.role, row.index),
                port=port,
                transport=transport,
                python=IMAGE_PYTHON,
            )
            for row in where.rows
        )
    )


def on_nodes(loaded: LoadedSpec, nodes: Mapping[TaskKey, str]) -> Placements:
    """The Slurm backend's table: each task on its node of ``nodes`` (slurm.place's decision),
    addressed by the node's hostname, running program.python (else this launcher's interpreter,
    the same path on a cluster) in the spec's workdir (a cluster shares its filesystem)."""
    rows = []
    wanted = []
    for role, index, entry in _entries(loaded):
        node = nodes[(role, index)]
        rows.append(
            Placement(
                role=role,
                index=index,
                host_name=node,
                machine=node,
                address=node,
                port=_fixed_port(entry),
                gpus=(),
                transport=TaskTransport.SLURM,
                python=launcher_python(loaded),
                cwd=str(loaded.workdir),
            )
        )
        wanted.append(entry.gpus)
    return _with_gpus(rows, wanted)


def launcher_python(loaded: LoadedSpec) -> str:
    """The interpreter of a task that sees this launcher's files: program.python, else the
    launcher's own."""
    return loaded.spec.program.python or sys.executable


def _entries(loaded: LoadedSpec) -> list[tuple[str, int, TaskEntry]]:
    return [
        (role, index, entry)
        for role, entries in loaded.spec.tasks.by_role().items()
        for index, entry in enumerate(entries)
    ]


def _fixed_port(entry: TaskEntry) -> int | None:
    return entry.port if isinstance(entry.port, int) else None


def _with_gpus(rows: list[Placement], wanted: list[Gpus]) -> Placements:
    """``rows`` with their GPUs: a list of indices as written; a count takes the lowest indices
    that no other task on its machine holds."""
    claimed = {
        (row.machine, gpu)
        for row, gpus in zip(rows, wanted, strict=True)
        if isinstance(gpus, tuple)
        for gpu in gpus
    }
    next_free: dict[str, int] = {}
    out = []
    for row, gpus in zip(rows, wanted, strict=True):
        picked: tuple[int, ...] = ()
        if isinstance(gpus, tuple):
            picked = gpus
        elif isinstance(gpus, int) and gpus > 0:
            found: list[int] = []
            while len(found) < gpus:
                gpu = next_free.get(row.machine, 0)
                if (row.machine, gpu) not in claimed:
                    found.append(gpu)
                next_free[row.machine] = gpu + 1
            picked = tuple(found)
        out.append(replace(row, gpus=picked))
    return Placements(tuple(out))
