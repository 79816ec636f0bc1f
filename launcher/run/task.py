"""One task of a run as the loop tracks it: its plan, its ledger and its current incarnation.

Its process is the `Crew`'s to start and end; its record the `Journal`'s to write.
"""

from __future__ import annotations

from pathlib import Path

from distlaunch.launcher.core.console import LogFollower
from distlaunch.launcher.plan.plan import TaskPlan
from distlaunch.launcher.record import rundir
from distlaunch.launcher.record.endings import EventKind
from distlaunch.launcher.record.state import TaskLedger
from distlaunch.launcher.transports.base import TaskHandle
from distlaunch.worker import contract


class Task:
    """One task as the loop tracks it: its plan, its latest incarnation and its ledger."""

    def __init__(self, plan: TaskPlan, number: int, ledger: TaskLedger) -> None:
        self.plan = plan
        self.number = number
        self.ledger = ledger
        self.handle: TaskHandle | None = None
        self.follower: LogFollower | None = None
        self.exit_code: int | None = None  # set once this incarnation has ended
        self.ending = EventKind.EXITED  # how this incarnation ended (it may be the root cause)
        self.started = 0.0  # time.monotonic() of this incarnation's start

    @property
    def name(self) -> str:
        """The task's name (``worker-1``)."""
        return self.plan.name

    @property
    def alive(self) -> bool:
        """Whether the current incarnation runs (started and not yet ended)."""
        return self.handle is not None and self.exit_code is None

    @property
    def training(self) -> bool:
        """Whether the task is part of the training cluster (all but the evaluator)."""
        return self.plan.role != contract.EVALUATOR

    def status(self, run_dir: Path) -> dict:
        """The status file of the current incarnation; {} when it has written none."""
        plan = self.plan
        found = rundir.read_json(contract.status_path(run_dir, plan.role, plan.index))
        if not isinstance(found, dict) or found.get("attempt") != self.ledger.entry.attempt:
            return {}
        return found
