"""Restarts carried out: the attempt counter, the restarts waiting out their backoff, and the
history the policy decides the next one on.

A RESTART decision names tasks and a delay: `schedule` kills the named tasks still running at once
(they hold no state that the checkpoint does not, and an MWMS worker blocked in a collective
would sit out SIGTERM's grace anyway), moves the run to its next attempt (a new log and error
file per task, the same ports and TF_CONFIG) and `due` hands the tasks back when their delay is
out. Each attempt's tasks are planned from `plan` (`plan.for_attempt`): a decision that restarts
the gang at another world size would replace it here and restart every task.
"""

from __future__ import annotations

import time
from pathlib import Path

from distlaunch.launcher.plan.plan import Plan, TaskPlan, for_attempt
from distlaunch.launcher.record import rundir
from distlaunch.launcher.run.crew import Crew
from distlaunch.launcher.run.journal import Journal
from distlaunch.launcher.run.policy import Action, Decision, History


class Restarts:
    """The run's attempts and the restarts under way."""

    def __init__(self, plan: Plan, crew: Crew, journal: Journal) -> None:
        self.plan = plan  # what each attempt's tasks are planned from
        self.crew = crew
        self.journal = journal
        self.attempt = plan.attempt
        self.pending: list[tuple[float, tuple[str, ...]]] = []  # (due time, tasks) restarts
        self._times: list[float] = []  # when each automatic restart was decided
        self.peer_lost: set[str] = set()  # tasks of this attempt that exited with a follow-on error
        self.last_fingerprint: str | None = None  # the traceback behind the latest restart

    def history(self) -> History:
        """What the policy knows of the run's restarts so far."""
        return History(tuple(self._times), frozenset(self.peer_lost), self.last_fingerprint)

    def waiting(self) -> list[str]:
        """The tasks waiting out a restart's backoff, the earliest first."""
        return [name for _, names in self.pending for name in names]

    def next_due(self) -> float | None:
        """When the next restart is due (time.monotonic()), None when none waits."""
        return min((due for due, _ in self.pending), default=None)

    def schedule(self, decision: Decision, manual: bool) -> None:
        """Carry out a RESTART: kill its tasks that still run, move to the next attempt, and
        start them once ``decision.delay_s`` is out (`due`)."""
        names = decision.tasks
        self.crew.kill([self.crew[n] for n in names if self.crew[n].alive])
        if not manual:
            self._times.append(time.monotonic())
        self.attempt += 1
        run_dir = Path(self.plan.run_dir)
        private = rundir.file_mode(run_dir) & 0o066 == 0
        rundir.make_dirs(run_dir, self.attempt, private=private)
        self.pending = [(due, rest) for due, rest in self.pending if not set(rest) & set(names)]
        self.pending.append((time.monotonic() + decision.delay_s, names))
        self.journal.attempt(self.attempt)

    def resize(self, plan: Plan, names: tuple[str, ...]) -> None:
        """Restart the gang as ``names`` of ``plan``, a new world's (its tasks all ended): the
        next attempt is planned from it. A new world starts with the whole restart budget: the
        failures that exhausted it were the place's now left out (resizes have their own)."""
        self.plan = plan
        self._times.clear()
        self.last_fingerprint = None
        self.schedule(Decision(Action.RESTART, "resize", names), manual=True)

    def due(self, now: float) -> list[TaskPlan]:
        """The plans of the tasks whose restart is due, in the current attempt."""
        due = [name for when, names in self.pending if when <= now for name in names]
        if not due:
            return []
        self.pending = [(when, names) for when, names in self.pending if when > now]
        # Same ports and TF_CONFIG; a new DISTLAUNCH_ATTEMPT, log file and error file.
        plan = for_attempt(self.plan, self.attempt)
        return [plan.task(name) for name in due]

    def cancel(self) -> None:
        """No restart will start (training is done)."""
        self.pending.clear()
