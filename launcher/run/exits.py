"""What a task's end means as data: the event the policy hears, and the failure a run reports.

An exit is read once, here: its words (an OOM kill named as such, from the kernel's count and the
task's last RSS), its error file's evidence (a follow-on error of a peer's death, the traceback's
fingerprint that tells a crash loop, the peers TensorFlow names as lost) and the exception type.
A FAIL decision becomes a `Failure` naming the root cause: the decision's cause, not a survivor
that only lost a peer. Nothing here touches a process (the stacks come from the `Crew`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from distlaunch.launcher.diagnosis.oom import OomKills
from distlaunch.launcher.plan.plan import TaskPlan
from distlaunch.launcher.record import rundir
from distlaunch.launcher.record.endings import EventKind
from distlaunch.launcher.run.crew import Crew
from distlaunch.launcher.run.policy import Decision, TaskEvent
from distlaunch.launcher.run.task import Task
from distlaunch.launcher.transports.base import exit_description
from distlaunch.worker import contract

if TYPE_CHECKING:
    from distlaunch.launcher.diagnosis import evidence
    from distlaunch.launcher.diagnosis.summary import Failure


class Exits:
    """Reads the tasks' ends for the supervisor (``rss``: a task's last RSS, by name;
    ``elapsed``: the run's seconds so far)."""

    def __init__(
        self, crew: Crew, rss: Callable[[str], int | None], elapsed: Callable[[], float]
    ) -> None:
        self.crew = crew
        self.run_dir = crew.run_dir
        self._rss = rss
        self._elapsed = elapsed
        self._oom = OomKills()  # counts the kernel's OOM kills from here on

    def follow_on(self, task: Task) -> bool:
        """Whether the task's error is a follow-on error of a peer's death (its evidence)."""
        from distlaunch.launcher.diagnosis import evidence

        return evidence.peer_lost(self._evidence(task.plan))

    def event(self, task: Task, code: int) -> tuple[TaskEvent, str]:
        """The EXITED event of ``task``'s exit with ``code``, and the words for it."""
        from distlaunch.launcher.diagnosis import evidence

        how = exit_description(code)
        if code != 0:
            rss = self._rss(task.name)
            how = self._oom.kill_of(self.crew.program(task), code, rss) or how
        found = self._evidence(task.plan) if code != 0 else None
        lost = evidence.peer_lost(found)
        # A follow-on error repeats whenever a peer dies (a chaos test kills one again and again):
        # only a task's own traceback can make a crash loop.
        event = TaskEvent(
            task.name, task.plan.role, code, self._error_type(task.plan), peer_lost=lost,
            fingerprint=None if lost else evidence.fingerprint(found),
            lost_peers=evidence.lost_tasks(found) if lost else (),
        )  # fmt: skip
        return event, how

    def failure(
        self, task: Task, event: TaskEvent, decision: Decision, how: str, where: tuple[str, ...]
    ) -> Failure:
        """The failure to report: the decision's cause (not a survivor that only lost a peer)."""
        note = decision.note
        if decision.cause == task.name:
            return self._failure(task, how, note, where, event.kind, event.returncode)
        follow_on = f"{task.name} {how} with a follow-on error: peer lost"
        if decision.cause is None:
            # Nobody has died on their own (yet): the stacks of the others show who is stuck.
            where = self.crew.stacks_where()
            note = "; ".join(x for x in ("peer lost: no other task had failed", note) if x)
            return self._failure(task, how, note, where, event.kind, event.returncode)
        cause = self.crew[decision.cause]
        if cause.alive:
            # Named lost by its peers but still there (frozen, or cut off): show where it is.
            where = self.crew.stacks_where()
            cause_how = "stopped answering its peers (its process was still there)"
            kind, code = EventKind.HUNG, None
        else:
            cause_how = str(cause.ledger.entry.exit or "failed")
            kind = cause.ending
            code = cause.exit_code if kind is EventKind.EXITED else None
        note = "; ".join(x for x in (note, follow_on) if x)
        return self._failure(cause, cause_how, note, where, kind, code)

    def _failure(
        self,
        task: Task,
        how: str,
        note: str,
        where: tuple[str, ...],
        kind: EventKind,
        exit_code: int | None,
    ) -> Failure:
        from distlaunch.launcher.diagnosis.summary import Failure

        attempt = task.ledger.entry.attempt
        plan = task.plan
        return Failure(
            task=task.name,
            how=how,
            log_file=plan.log_file,
            error_file=str(contract.error_path(self.run_dir, attempt, plan.role, plan.index)),
            elapsed_s=self._elapsed(),
            note=note,
            stacks=where,
            stacks_dir=self.crew.stacks_dir if where else "",
            kind=kind,
            exit_code=exit_code,
        )

    def _evidence(self, plan: TaskPlan) -> evidence.Evidence | None:
        from distlaunch.launcher.diagnosis.summary import Failure, evidence_of

        error_file = contract.error_path(self.run_dir, plan.attempt, plan.role, plan.index)
        return evidence_of(Failure(plan.name, "", plan.log_file, str(error_file), 0.0))

    def _error_type(self, plan: TaskPlan) -> str | None:
        error = rundir.read_json(Path(plan.env[contract.ERROR_FILE]))
        return error.get("type") if isinstance(error, dict) else None
