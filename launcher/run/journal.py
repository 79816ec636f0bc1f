"""The run's record as the supervisor writes it: one method per thing that happens.

Every write of run.json and events.jsonl that the loop makes goes through here: a task's start,
its join, its end (an exit with the policy's decision, a hang, a kill or stop by the launcher), a
restart request, the run's stop notice and its warm standbys. Each writes the task's ledger
(`state.TaskLedger`: its state changes as `state.TASK_TRANSITIONS` allow) or the run's record,
and nothing here decides or touches a process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from distlaunch.launcher.record.state import RunBook, RunRecord, RunState, TaskState
from distlaunch.launcher.run.policy import Decision
from distlaunch.launcher.transports.base import TaskHandle, exit_description

if TYPE_CHECKING:
    from distlaunch.launcher.run.task import Task


class Journal:
    """The writer of one run's record for its supervisor."""

    def __init__(self, book: RunBook) -> None:
        self.book = book

    @property
    def record(self) -> RunRecord:
        """The run's record, as run.json has it."""
        return self.book.record

    @contextmanager
    def batch(self) -> Iterator[None]:
        """One save of run.json for every change of the block (see `RunBook.batch`)."""
        with self.book.batch():
            yield

    def save(self) -> None:
        """Save run.json (at the end of the current batch, if any)."""
        self.book.save()

    def set_state(self, state: RunState) -> None:
        """Move the run to ``state``."""
        self.book.set_state(state)

    def started(self, task: Task, handle: TaskHandle, restarts: int) -> None:
        """A new incarnation of ``task`` started (``restarts``: how many before it)."""
        started = {
            "attempt": task.plan.attempt,
            "pid": handle.pid,
            "pgid": handle.pid,
            "started_at": time.time(),
            "restarts": restarts,
            "exit_code": None,
            "exit": None,
            "ended_at": None,
            "joined_after_s": None,
        }
        event = "restarted" if restarts else "started"
        warm = {"standby": True} if handle.warm else {}
        task.ledger.change(TaskState.STARTING, event, started, pid=handle.pid, **warm)

    def joined(self, task: Task, after_s: float) -> None:
        """``task``'s TensorFlow server is up, ``after_s`` after its start."""
        joined = {"joined_after_s": round(after_s, 3)}
        task.ledger.change(TaskState.RUNNING, "joined", joined, port=task.plan.port)

    def ended(self, task: Task, state: TaskState, event: str, code: int, reason: str) -> None:
        """The launcher has just stopped or killed ``task`` (it ended with ``code``)."""
        how = exit_description(code)
        ended = {"exit_code": code, "exit": how, "ended_at": time.time()}
        task.ledger.change(state, event, ended, exit=how, reason=reason)

    def exited(
        self, task: Task, state: TaskState, how: str, decision: Decision, **more: Any
    ) -> None:
        """``task`` exited on its own (``how``), and the policy decided ``decision``."""
        code = task.exit_code
        ended = {"exit_code": code, "exit": how, "ended_at": time.time()}
        task.ledger.change(
            state, "exited", ended, decision=decision.action.value, reason=decision.reason,
            exit=how, exit_code=code, **more,
        )  # fmt: skip

    def hung(
        self, task: Task, how: str, decision: Decision, silent_s: float, where: tuple[str, ...]
    ) -> None:
        """``task`` stopped making progress and was killed; the policy decided ``decision``."""
        ended = {"exit": how, "ended_at": time.time()}
        task.ledger.change(
            TaskState.FAILED, "hung", ended, decision=decision.action.value,
            reason=decision.reason, silent_s=round(silent_s, 1), stacks=list(where),
        )  # fmt: skip

    def restart_requested(self, task: Task, decision: Decision) -> None:
        """A user asked for ``task``'s restart (`distlaunch restart`)."""
        task.ledger.note(
            "restart-requested", decision=decision.action.value, reason=decision.reason
        )

    def attempt(self, attempt: int) -> None:
        """The run moved on to ``attempt`` (a restart)."""
        self.record.attempt = attempt
        self.book.save()

    def notice(self, attempt: int, record: dict[str, Any] | None, **fields: Any) -> None:
        """A stop notice came (``fields``: its event's); ``record``: run.json's notice, if it
        changes (`distlaunch down` reports it)."""
        if record is not None:
            self.record.notice = record
            self.book.save()
        self.book.event("run", "notice", attempt, **fields)

    def notice_ended(self, **how: object) -> None:
        """Record how the notice ended in run.json."""
        self.record.notice = {**(self.record.notice or {}), **how}
        self.book.save()

    def resized(self, attempt: int, world: dict, **fields: Any) -> None:
        """An elastic run's world changed (``fields``: old, new, reason, step, hosts); ``world``
        is run.json's new ``world``."""
        self.record.world = world
        self.book.save()
        self.book.event("run", "resized", attempt, **fields)

    def world(self, world: dict) -> None:
        """run.json's ``world`` (an elastic run's), when it changed."""
        if world != self.record.world:
            self.record.world = world
            self.book.save()

    def standbys(self, record: dict | None) -> None:
        """The warm standbys there are now (None: none), when that changed."""
        if record != self.record.standbys:
            self.record.standbys = record
            self.book.save()
