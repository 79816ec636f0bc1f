"""A stop notice under way: who it went to, who still waits for it, when its save is due, and
what the tasks saved.

A notice (SIGTERM or SIGUSR2 to the launcher) is sent to every training task's program through
the transport's ``notify`` (`send`); a task still starting (no "ready" in its status: importing
TensorFlow, building the strategy, where a SIGTERM would kill it) gets its notice held until it
can take it (`release_held`). What a notice means (send it, join the one under way, stop, the run
preempted) is the policy's (`policy.RestartPolicy`); this object keeps the facts it is decided on
(`facts`) and carries out the sending. The save's deadline is timeouts.save_s (`overdue`).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from distlaunch.launcher.core.console import Console
from distlaunch.launcher.core.errors import Interrupted
from distlaunch.launcher.record import rundir
from distlaunch.launcher.record.state import TaskState
from distlaunch.launcher.run.journal import Journal
from distlaunch.launcher.transports.base import TaskHandle
from distlaunch.worker import contract

if TYPE_CHECKING:
    from distlaunch.launcher.run.crew import Crew
    from distlaunch.launcher.run.task import Task

# The stop signals that are a stop notice while none is under way (see the module docstring).
NOTICE_SIGNALS = (signal.SIGTERM, rundir.PRE_TIMEOUT_SIGNAL)


@dataclass(frozen=True)
class Preemption:
    """What a preempted run saved: the step of its checkpoint (None: the program saved on its
    own, or had no checkpoint dir) and the longest save, from the tasks' status files."""

    step: int | None
    save_s: float | None
    late: bool = False  # the save ended after timeouts.save_s, in the grace period


@dataclass(frozen=True)
class Notice:
    """A stop notice under way: the signal that brought it and when its save is due."""

    signum: int
    deadline: float  # time.monotonic()
    send: Callable[[list[TaskHandle]], bool]  # the transport's notify
    at: float  # time.monotonic() of the notice
    step: int | None  # the latest checkpoint's step when it came (the checkpoint index's)
    # An elastic run's resize (the launcher's own notice, not a stop): once saved, the gang
    # restarts in the new world, whose words these are (e.g. "world 2 -> 3: h3 answers again").
    resize: str = ""


class StopNotices:
    """The run's stop notices: the one under way (`current`), how many came, the held ones."""

    def __init__(
        self,
        crew: Crew,
        journal: Journal,
        console: Console,
        savers: list[str],
        save_s: float,
        save_why: str,
    ) -> None:
        self.crew = crew
        self.journal = journal
        self.console = console
        self.savers = savers  # the tasks a notice goes to (`policy.Cluster.savers`)
        self.save_s = save_s
        self.save_why = save_why  # what set save_s, for the notice's lines
        self.current: Notice | None = None
        self.count = 0  # stop notices so far
        # Training tasks whose notice is held until they can take it (see `takes_notice`).
        self.held: set[str] = set()

    def facts(self, unkeepable: str) -> dict:
        """The run's history as a notice's decision needs it (`policy.History`'s fields)."""
        return {
            "notices": self.count,
            "unkeepable": unkeepable,
            "held": frozenset(n for n in self.held if self.crew[n].alive),
        }

    def send(
        self,
        signum: int,
        attempt: int,
        notify: Callable[[list[TaskHandle]], bool],
        resize: str = "",
    ) -> None:
        """Send every running training task a stop notice (``notify``: the transport's), or hold
        it for those still starting. ``resize``: the notice is an elastic run's save before its
        world changes (its words), not a stop."""
        from distlaunch.launcher.record import checkpoints

        savers = [t for n in self.savers if (t := self.crew[n]).alive]
        self.held = {t.name for t in savers if not self.takes_notice(t)}
        now = time.monotonic()
        index = checkpoints.resume_point(contract.checkpoint_dir(self.crew.run_dir))
        step = index.step if index else None
        self.current = Notice(signum, now + self.save_s, notify, now, step, resize)
        ready = [t.handle for t in savers if t.name not in self.held]
        if ready and not notify(ready):
            self.console.say("the transport cannot deliver a stop notice: stopping the run")
            raise Interrupted(signum)
        name = signal.Signals(signum).name
        held = ""
        if self.held:
            held = (
                f"; {', '.join(sorted(self.held))} still starting: "
                "its notice waits until it can take it"
            )
        what = f"{resize}: saving first" if resize else f"stop notice ({name})"
        self.console.say(
            f"{what}: asking {len(savers)} tasks to save and stop within "
            f"{self.save_s:g} s ({self.save_why}){held}"
        )
        if resize:
            self.journal.notice(attempt, None, resize=resize, save_s=self.save_s)
            return
        record = {"signal": name, "at": time.time(), "save_s": self.save_s}
        self.journal.notice(
            attempt, record, signal=name, save_s=self.save_s, held=sorted(self.held)
        )

    def join(self, name: str, attempt: int) -> None:
        """A second notice: the save under way goes on; say which step, since when."""
        assert self.current is not None
        step = self._saving_step()
        since = time.monotonic() - self.current.at
        left = max(0.0, self.current.deadline - time.monotonic())
        at = f"step {step}" if step is not None else "its tasks"
        self.console.say(
            f"stop notice again ({name}): saving {at}, started {since:.0f} s ago, due within "
            f"{left:.0f} s; joining it (Ctrl-C or `distlaunch down --now` stops without saving)"
        )
        self.journal.notice(attempt, None, signal=name, joined=True)

    def as_stop(self) -> None:
        """A real stop notice came while a resize's save was under way: that save is the
        stop's now (the run ends preempted once it is done; nothing restarts)."""
        assert self.current is not None
        self.current = replace(self.current, resize="")
        self.count = max(self.count, 1)

    def ended(self) -> None:
        """A resize's save is over: no notice is under way any more."""
        self.current = None
        self.held.clear()

    def release_held(self) -> None:
        """Send the held notices of the tasks that can take them now."""
        assert self.current is not None
        for name in sorted(self.held):
            task = self.crew[name]
            if not task.alive:
                self.held.discard(name)
            elif self.takes_notice(task):
                self.held.discard(name)
                if not self.current.send([task.handle]):
                    self.console.say("the transport cannot deliver a stop notice: stopping")
                    raise Interrupted(self.current.signum)

    def overdue(self, now: float) -> list[Task]:
        """The training tasks still running once the save is due (timeouts.save_s); [] before."""
        assert self.current is not None
        unsaved = [t for n in self.savers if (t := self.crew[n]).alive]
        return unsaved if now >= self.current.deadline else []

    def takes_notice(self, task: Task) -> bool:
        """Whether the task's program can take a notice now: distlaunch's or the program's own
        handler is in (status "ready" or later: dw.strategy() built the strategy); or, for a
        program that reports no status, its TensorFlow server is up. Before that (importing
        TensorFlow, building the strategy) a SIGTERM would kill it, or TensorFlow's own handler
        would swallow it (worker/preempt.py)."""
        state = task.status(self.crew.run_dir).get("state")
        if state is not None:
            return state != contract.STATE_STARTING
        assert task.handle is not None
        return task.ledger.state is TaskState.RUNNING or task.handle.joined()

    def _saving_step(self) -> int | None:
        """The step the savers are saving, or the latest they reported (their status files)."""
        steps = []
        for name in self.savers:
            status = self.crew[name].status(self.crew.run_dir)
            step = status.get(contract.SAVED_STEP, status.get("step"))
            if isinstance(step, int):
                steps.append(step)
        return max(steps) if steps else None

    def saved(self, task: Task) -> dict | None:
        """The task's status file if this incarnation reported saving on the notice."""
        status = task.status(self.crew.run_dir)
        return status if status.get("state") == contract.STATE_PREEMPTED else None

    def preemption(self) -> Preemption:
        """The step the training tasks saved (the chief's, which is everyone's) and the longest
        save, from their status files."""
        steps, times = [], []
        for task in self.crew:
            status = self.saved(task)
            if status is None:
                continue
            if isinstance(status.get(contract.SAVED_STEP), int):
                steps.append(status[contract.SAVED_STEP])
            if isinstance(status.get(contract.SAVE_S), (int, float)):
                times.append(float(status[contract.SAVE_S]))
        return Preemption(max(steps) if steps else None, max(times) if times else None)

    def what_was_saved(self) -> str:
        """What a resume would start from, from the checkpoint index (what the tasks saved even
        when they could not say so)."""
        from distlaunch.launcher.record import checkpoints

        assert self.current is not None
        index = checkpoints.resume_point(contract.checkpoint_dir(self.crew.run_dir))
        if index is None:
            return "no checkpoint: `up --resume` starts over"
        if self.current.step is None or index.step > self.current.step:
            return f"{index.name} was saved after the notice: `up --resume` continues from it"
        return f"nothing saved on the notice: `up --resume` continues from {index.name}"

    def stopped(self, why: str) -> Interrupted:
        """The run stops on the notice as a signal stops it (``why``, recorded): the error to
        raise."""
        assert self.current is not None
        self.journal.notice_ended(stopped=why)
        return Interrupted(self.current.signum)


def training_done(run_dir: Path, attempt: int) -> bool:
    """Whether the chief wrote the "training done" marker (contract.training_done_path) for
    ``attempt``."""
    marker = rundir.read_json(contract.training_done_path(run_dir))
    return isinstance(marker, dict) and marker.get("attempt") == attempt


def mark_stop_now(run_dir: Path, attempt: int) -> None:
    """Tell the attempt's tasks that the SIGTERM coming is no stop notice (see worker/preempt.py);
    best effort: a task that does not see it saves within the grace period, or is killed."""
    path = contract.stop_now_path(run_dir, attempt)
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        rundir.create_file(path)
    except OSError:
        pass
