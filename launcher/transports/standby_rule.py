"""The rule every warm-standby pool keeps (the local one, launcher/transports/local/standby.py,
and the agents', launcher/transports/agent_standby.py): which standbys to keep, discard and start
when the supervisor names the next attempt's tasks. A pure decision from the pool as it is
(`reconcile`); `ReconciledPool.prepare` carries it out the same way for both pools, each saying
only how one of its standbys is made and discarded (a local process, or an agent asked to).

The rule: a standby is kept only while it is alive and was made for exactly the task plan wanted;
every other one is discarded, and a task whose standby died is cold from then on (a standby
there would die again: the run restarts it cold). Each wanted task with no standby kept and not
cold gets a new one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from distlaunch.launcher.core.backends import TaskTransport
from distlaunch.launcher.plan.plan import TaskPlan


@dataclass(frozen=True)
class Held:
    """One standby of a pool as the rule sees it."""

    task: TaskPlan  # the attempt it was made for
    alive: bool


@dataclass(frozen=True)
class Reconcile:
    """What a pool does to have a standby for exactly the wanted tasks."""

    discard: tuple[str, ...]  # tasks whose standby goes (stale or dead), in the pool's order
    died: frozenset[str]  # tasks whose standby died: they restart cold from now on
    start: tuple[TaskPlan, ...]  # tasks to make a standby for, in the order they were named


def reconcile(
    held: Mapping[str, Held], tasks: Sequence[TaskPlan], kind: TaskTransport, cold: Set[str]
) -> Reconcile:
    """What a pool holding ``held`` (per task name), with ``cold`` tasks that get no standby,
    does to have a standby for exactly each of ``tasks`` it runs (those of transport ``kind``)."""
    wanted = {t.name: t for t in tasks if t.transport == kind}
    died = frozenset(name for name, h in held.items() if not h.alive)
    discard = tuple(name for name, h in held.items() if not h.alive or wanted.get(name) != h.task)
    kept = held.keys() - set(discard)
    start = tuple(
        task for name, task in wanted.items() if name not in kept and name not in cold | died
    )
    return Reconcile(discard, died, start)


class _Standby(Protocol):
    task: TaskPlan

    def alive(self) -> bool: ...


S = TypeVar("S", bound=_Standby)


class ReconciledPool(ABC, Generic[S]):
    """The part both standby pools share: the standbys held, the cold tasks, and `prepare`,
    which carries out `reconcile` with the pool's own `_make` and `_discard`."""

    kind: TaskTransport  # the tasks the pool has standbys for

    def __init__(self) -> None:
        self._standbys: dict[str, S] = {}
        self._cold: set[str] = set()  # tasks whose standby could not be made or died unused

    def prepare(self, tasks: Sequence[TaskPlan]) -> None:
        """Have a standby for exactly each of ``tasks`` the pool serves: keep those made for it,
        discard the others, make the missing ones."""
        held = {name: Held(s.task, s.alive()) for name, s in self._standbys.items()}
        step = reconcile(held, tasks, self.kind, self._cold)
        self._cold |= step.died
        for name in step.discard:
            self._discard(self._standbys.pop(name))
        for task in step.start:
            standby = self._make(task)
            if standby is None:
                self._cold.add(task.name)
            else:
                self._standbys[task.name] = standby

    @abstractmethod
    def _make(self, task: TaskPlan) -> S | None:
        """Start a standby for ``task`` (None: none can be made; the task restarts cold)."""

    @abstractmethod
    def _discard(self, standby: S) -> None:
        """End a standby that will not be used."""
