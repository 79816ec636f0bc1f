"""The plan of one world of an elastic run: which worker slots train now, and what each task is
told about it.

`make_plan` plans every worker slot the spec allows (elastic.workers' MAX): the FULL plan. A world
is a choice of those slots; `world_plan` (pure) keeps the non-worker tasks and the chosen worker
slots, renumbers the workers 0..k-1 in slot order (TensorFlow's task index: under MWMS without a
chief role, worker 0 is the chief), and rewrites what names the cluster or the index: TF_CONFIG
(every training task's cluster; the evaluator's is its own and stays), DISTLAUNCH_INDEX, the
error, status and metrics files, and the env that names the world. Ports, hosts, GPUs and CPUs
belong to the slot and stay with it.

Task names follow the world: ``worker-1`` is the second worker of the current world, wherever
its slot is; run.json's ``world`` says which slot (and host) each name holds now, and every
``resized`` event names the hosts of the new world.

Where a slot can be lost or held out (`Slot.place`): its host, for a task on another machine
(an SSH host, a Slurm node: losing the machine loses all its slots); the slot itself on this
machine (a local run's slots share one host that cannot be lost, so restarts exhausted hold out
that slot alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distlaunch.launcher.core.backends import TaskTransport
from distlaunch.launcher.plan import tfconfig
from distlaunch.worker import contract

if TYPE_CHECKING:
    from distlaunch.launcher.plan.plan import Plan, TaskPlan

# The env a worker reads of its world (worker/contract.py holds these names once E3's part of
# issue 49 is in; they are the same literal names).
ELASTIC_BATCH = "DISTLAUNCH_ELASTIC_BATCH"  # "global" | "per_worker"; absent: not elastic
WORLD_SIZE = "DISTLAUNCH_WORLD_SIZE"  # the workers of this world
BASE_WORKERS = "DISTLAUNCH_BASE_WORKERS"  # MAX: the world the user's batch numbers were written for
WORLD = "DISTLAUNCH_WORLD"  # for people: "2 of 2:3"


@dataclass(frozen=True)
class Slot:
    """One worker slot of the full plan: its task name there, its host, and its place (what is
    lost or held out: see the module docstring)."""

    name: str
    host: str
    place: str


@dataclass(frozen=True)
class ElasticPlan:
    """The spec's elastic section as the run needs it, with the full plan's worker slots."""

    min_workers: int
    max_workers: int
    sizes: tuple[int, ...] | None
    batch: str
    slots: tuple[Slot, ...]
    resizes: int = 10
    lost_after_s: float = 10.0
    settle_s: float = 10.0
    interval_s: float = 30.0
    cooldown_s: float = 30.0
    cooldown_max_s: float = 600.0
    probe_s: float = 5.0

    @property
    def range_text(self) -> str:
        """The range as the spec writes it: ``2:3``."""
        return f"{self.min_workers}:{self.max_workers}"

    def accepted(self, size: int) -> bool:
        """Whether a world of ``size`` workers may run: within MIN..MAX and, if the spec lists
        the sizes the program accepts, one of them."""
        in_range = self.min_workers <= size <= self.max_workers
        return in_range and (self.sizes is None or size in self.sizes)

    def best_size(self, available: int) -> int | None:
        """The largest accepted world that ``available`` slots can hold; None when none can."""
        return next((n for n in range(available, 0, -1) if self.accepted(n)), None)

    def first_world(self) -> tuple[str, ...]:
        """The slots of the first world: the largest accepted size, the first slots in order."""
        size = self.best_size(len(self.slots)) or 0
        return tuple(s.name for s in self.slots[:size])

    def slot(self, name: str) -> Slot:
        """The slot called ``name`` (KeyError if none)."""
        for slot in self.slots:
            if slot.name == name:
                return slot
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        """What run.json and `plan --json` show of it."""
        return {
            "workers": self.range_text,
            "sizes": list(self.sizes) if self.sizes is not None else None,
            "batch": self.batch,
            "slots": [{"name": s.name, "host": s.host, "place": s.place} for s in self.slots],
        }


def elastic_plan(elastic: Any, tasks: Sequence[TaskPlan]) -> ElasticPlan | None:
    """The run's ElasticPlan from the spec's typed `Elastic` (None: not elastic) and the full
    plan's tasks (its worker slots)."""
    if elastic is None:
        return None
    slots = tuple(Slot(t.name, t.host_name, _place(t)) for t in tasks if t.role == contract.WORKER)
    return ElasticPlan(
        min_workers=elastic.min_workers,
        max_workers=elastic.max_workers,
        sizes=tuple(elastic.sizes) if elastic.sizes is not None else None,
        batch=elastic.batch,
        slots=slots,
        resizes=elastic.resizes,
        lost_after_s=elastic.lost_after_s,
        settle_s=elastic.settle_s,
        interval_s=elastic.interval_s,
        cooldown_s=elastic.cooldown_s,
        cooldown_max_s=elastic.cooldown_max_s,
        probe_s=elastic.probe_s,
    )


def _place(task: TaskPlan) -> str:
    if task.transport == TaskTransport.LOCAL:
        return f"{task.name}@{task.host_name}"
    return task.host_name


def world_plan(full: Plan, slots: Sequence[str]) -> Plan:
    """The plan of the world made of worker ``slots`` (names of the full plan's workers): the
    non-worker tasks and those workers, renumbered in slot order, every TF_CONFIG and the env
    that names the index or the world rewritten; ports kept. ValueError for a name that is no
    worker slot of ``full``, or a plan that is not elastic."""
    elastic = full.elastic
    if elastic is None:
        raise ValueError("world_plan needs an elastic plan")
    chosen = set(slots)
    workers = [t for t in full.tasks if t.role == contract.WORKER]
    unknown = chosen - {t.name for t in workers}
    if unknown:
        raise ValueError(f"no worker slot {', '.join(sorted(unknown))} in the plan")
    index = {t.name: i for i, t in enumerate(w for w in workers if w.name in chosen)}
    kept = [t for t in full.tasks if t.role != contract.WORKER or t.name in chosen]
    numbered = [(t, index.get(t.name, t.index)) for t in kept]
    addresses: dict[str, list[str]] = {}
    for task, i in numbered:
        addresses.setdefault(task.role, []).append(task.address)
    size = len(index)
    world_env = {
        ELASTIC_BATCH: elastic.batch,
        WORLD_SIZE: str(size),
        BASE_WORKERS: str(elastic.max_workers),
        WORLD: f"{size} of {elastic.range_text}",
    }
    run_dir = Path(full.run_dir)
    tasks = [_renumbered(t, i, addresses, world_env, run_dir) for t, i in numbered]
    return replace(full, tasks=tuple(tasks))


def _renumbered(
    task: TaskPlan, index: int, addresses: dict[str, list[str]], world_env: dict, run_dir: Path
) -> TaskPlan:
    """``task`` as task ``index`` of its role in the cluster of ``addresses``."""
    role, attempt = task.role, task.attempt
    if role == contract.EVALUATOR:
        config = task.tf_config  # a cluster of its own: nothing of the world's
    else:
        config = tfconfig.tf_config(addresses, role, index)
    env = dict(task.env)
    env.update(world_env)
    env.update(
        {
            contract.TF_CONFIG: tfconfig.dumps(config),
            contract.INDEX: str(index),
            contract.ERROR_FILE: str(contract.error_path(run_dir, attempt, role, index)),
            contract.STATUS_FILE: str(contract.status_path(run_dir, role, index)),
            contract.METRICS_FILE: str(contract.metrics_path(run_dir, role, index)),
        }
    )
    log_file = str(contract.log_path(run_dir, attempt, role, index))
    return replace(task, index=index, tf_config=config, env=env, log_file=log_file)
