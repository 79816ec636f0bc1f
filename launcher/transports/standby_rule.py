"""The rule every warm-standby pool keeps (the local one, launcher/transports/local/standby.py,
and the agents', launcher/transports/agent_standby.py): which standbys to keep, discard and start
when the supervisor names the next attempt's tasks. A pure decision from the pool as it is; the
pools do what it says (killing a local process, or asking an agent to).

The rule: a standby is kept only while it is alive and was made for exactly the task plan wanted;
every other one is discarded, and a task whose standby died is cold from then on (a standby
there would die again: the run restarts it cold). Each wanted task with no standby kept and not
cold gets a new one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

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
