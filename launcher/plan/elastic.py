"""An elastic run's range and worker slots, as its plan holds them (`Plan.elastic`).

Where a slot can be lost or held out (`Slot.place`): its host, for a task on another machine
(an SSH host, a Slurm node: losing the machine loses all its slots); the slot itself on this
machine (a local run's slots share one host that cannot be lost, so restarts exhausted hold out
that slot alone). `world.world_plan` makes the plan of one world of these slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from distlaunch.launcher.core.backends import TaskTransport
from distlaunch.launcher.spec.typed import Elastic
from distlaunch.worker import contract


@dataclass(frozen=True)
class Slot:
    """One worker slot of the full plan: its task name there, its host, and its place (what is
    lost or held out: see the module docstring)."""

    name: str
    host: str
    place: str


@dataclass(frozen=True)
class ElasticPlan(Elastic):
    """The spec's elastic section (its range, budgets and timings, as `Elastic` has them) with
    the full plan's worker slots."""

    slots: tuple[Slot, ...] = ()

    def best_size(self, available: int) -> int | None:
        """The largest accepted world that ``available`` slots can hold; None when none can."""
        return max((n for n in self.accepted() if n <= available), default=None)

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


def elastic_plan(elastic: Elastic | None, tasks: Sequence[Any]) -> ElasticPlan | None:
    """The run's ElasticPlan from the spec's typed `Elastic` (None: not elastic) and the full
    plan's tasks (`plan.TaskPlan`s, untyped here: plan.py imports this module)."""
    if elastic is None:
        return None
    slots = tuple(Slot(t.name, t.host_name, _place(t)) for t in tasks if t.role == contract.WORKER)
    return ElasticPlan(**{f.name: getattr(elastic, f.name) for f in fields(elastic)}, slots=slots)


def _place(task: Any) -> str:
    if task.transport == TaskTransport.LOCAL:
        return f"{task.name}@{task.host_name}"
    return task.host_name
