"""What each event of a run comes to: the policy's decision, carried out.

The supervisor's loop says when something happened (a task's exit, a passed deadline, a stop
notice, a restart request, a save's deadline); `Events` turns it into a `TaskEvent`, asks the
policy (`policy.RestartPolicy.decide`, with the run's history from its collaborators), records
the answer and carries it out through the collaborators: `Restarts` for a RESTART, the `Crew`
to stop tasks, `StopNotices` to send or join a notice, `Resizing` for an elastic run's world
(a place lost or held out, the world the membership policy decides). The run's `Phase`
(training, saving on a stop notice, draining the evaluator, deciding the world) says what an exit
means. Nothing here waits or loops.
"""

from __future__ import annotations

import enum
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from distlaunch.launcher.core.console import Console
from distlaunch.launcher.core.errors import Interrupted
from distlaunch.launcher.plan.plan import Plan
from distlaunch.launcher.record import rundir
from distlaunch.launcher.record.endings import EventKind
from distlaunch.launcher.record.state import RunState, TaskState
from distlaunch.launcher.run.crew import Crew
from distlaunch.launcher.run.deadlines import Deadlines, Lapse
from distlaunch.launcher.run.exits import Exits
from distlaunch.launcher.run.journal import Journal
from distlaunch.launcher.run.membership import Verdict
from distlaunch.launcher.run.notice import Preemption, StopNotices, mark_stop_now, training_done
from distlaunch.launcher.run.policy import Action, Decision, RestartPolicy, TaskEvent
from distlaunch.launcher.run.resizing import Resizing
from distlaunch.launcher.run.restarts import Restarts
from distlaunch.launcher.run.task import Task
from distlaunch.launcher.run.warm import WarmStandbys
from distlaunch.launcher.spec.model import Timeouts
from distlaunch.launcher.transports.base import Transport, exit_description
from distlaunch.worker import contract

if TYPE_CHECKING:
    from distlaunch.launcher.diagnosis.summary import Failure


class Phase(enum.Enum):
    """Where the run is: what a task's exit means, and which deadlines the loop checks."""

    TRAINING = "training"  # tasks start, join, train and restart: every deadline of `Deadlines`
    SAVING = "saving"  # a stop notice is under way: exits are saves (or not); the save's deadline
    DRAINING = "draining"  # training is done: the evaluator finishes within its drain time
    # An elastic run's gang is stopped (a place lost or held out) while its world is decided
    RESIZING = "resizing"


@dataclass(frozen=True)
class RunResult:
    """How a run ended."""

    state: RunState  # SUCCEEDED, FAILED or PREEMPTED
    failure: Failure | None
    preemption: Preemption | None = None


class Events:
    """The run's events, decided by the policy and carried out."""

    def __init__(
        self,
        plan: Plan,
        console: Console,
        timeouts: Timeouts,
        transport: Transport,
        policy: RestartPolicy,
        crew: Crew,
        journal: Journal,
        restarts: Restarts,
        deadlines: Deadlines,
        notices: StopNotices,
        standbys: WarmStandbys,
        resizing: Resizing | None = None,
    ) -> None:
        self.plan = plan
        self.resizing = resizing
        self.run_dir = Path(plan.run_dir)
        self.console = console
        self.timeouts = timeouts
        self.transport = transport
        self.policy = policy
        self.crew = crew
        self.journal = journal
        self.restarts = restarts
        self.deadlines = deadlines
        self.notices = notices
        self.standbys = standbys
        self.exits = Exits(
            crew,
            rss=deadlines.watchdog.rss.get,
            elapsed=lambda: time.monotonic() - deadlines.run_started,
        )

    @property
    def attempt(self) -> int:
        """The run's current attempt."""
        return self.restarts.attempt

    @property
    def phase(self) -> Phase:
        """The run's phase (a notice is never taken while draining, nor a drain begun while
        saving: training that is done makes a notice DONE, and a notice ends every attempt)."""
        if self.deadlines.drain_until is not None:
            return Phase.DRAINING
        if self.notices.current is not None:
            return Phase.SAVING
        down = self.resizing is not None and self.resizing.world.down
        return Phase.RESIZING if down else Phase.TRAINING

    def on_notice(self, signum: int) -> RunResult | None:
        """A stop notice: the policy sends it, joins the one under way, or ends the run."""
        name = signal.Signals(signum).name
        if self.notices.current is not None and self.notices.current.resize:
            self.notices.as_stop()  # the resize's save is the stop's now: nothing restarts
            assert self.resizing is not None
            self.resizing.world.pending = None
        event = TaskEvent("run", "", None, kind=EventKind.NOTICE, detail=name)
        decision = self._decide(event)
        notices = self.notices
        notices.count += 1
        if decision.action is Action.NOTIFY:
            notify = self.transport.notify  # type: ignore[attr-defined]  # the policy checked it
            notices.send(signum, self.attempt, notify)
            self.standbys.close()  # nothing restarts after a notice
            return None
        if decision.action is Action.CONTINUE:
            notices.join(name, self.attempt)
            return None
        if decision.action is Action.DONE:
            record = {"signal": name, "at": time.time(), "done": decision.reason}
            self.journal.notice(self.attempt, record, signal=name, reason=decision.reason)
            return self._done(cut=decision.reason)
        if notices.current is not None:
            self.console.say(f"{decision.reason}: stopping the run")
            raise notices.stopped(decision.reason)
        # Else the notice cannot be kept (the program cannot save on one, a task is down
        # waiting to restart): the run stops at once, as it always did.
        raise Interrupted(signum)

    def on_requests(self) -> RunResult | None:
        """`distlaunch restart`'s requests: each a MANUAL event of its task."""
        for name in rundir.take_restart_requests(self.run_dir):
            if name not in self.crew.tasks:
                continue
            task = self.crew[name]
            event = TaskEvent(name, task.plan.role, None, kind=EventKind.MANUAL)
            decision = self._decide(event)
            self.journal.restart_requested(task, decision)
            result = self._apply(task, event, decision, "")
            if result is not None:
                return result
        return None

    # ---- what happened ---------------------------------------------------------------------

    def _decide(self, event: TaskEvent) -> Decision:
        history = self.restarts.history()
        if event.kind in (EventKind.NOTICE, EventKind.PREEMPTED, EventKind.SAVE_TIMEOUT):
            unkeepable = self._unkeepable() if event.kind is EventKind.NOTICE else ""
            done = self.phase is Phase.DRAINING or training_done(self.run_dir, self.attempt)
            history = replace(history, training_done=done, **self.notices.facts(unkeepable))
        return self.policy.decide(event, self.crew.exited(), history, time.monotonic())

    def _unkeepable(self) -> str:
        """Why a stop notice cannot be kept now ("" when it can)."""
        if not self.plan.program.saves_on_notice:
            # program_scan: no dw.fit, no TensorFlow or Keras handler; it stops as it always did
            return "the program cannot save on a stop notice"
        if getattr(self.transport, "notify", None) is None:
            return "the transport cannot deliver a stop notice"
        if self.restarts.pending:
            return "a task is down, waiting to restart"
        if self.phase is Phase.RESIZING:
            return "the gang is stopped while the elastic run's world is decided"
        return ""

    def on_exit(self, task: Task) -> RunResult | None:
        """A task exited on its own: its exit fd is readable, `reap` takes its status."""
        code = self.crew.reap(task)
        task.ending = EventKind.EXITED
        state = TaskState.SUCCEEDED if code == 0 else TaskState.FAILED
        phase = self.phase
        if phase is Phase.SAVING:
            return self._on_saved(task, code)
        if phase is Phase.DRAINING:
            # Training already succeeded; the evaluator has now finished too.
            why = "the evaluator finished after training"
            event = TaskEvent(task.name, task.plan.role, code, kind=EventKind.DRAINED, detail=why)
            how = exit_description(code)
        else:
            event, how = self.exits.event(task, code)
            if event.peer_lost:
                self.restarts.peer_lost.add(task.name)
        decision = self._decide(event)
        if self.resizing is not None and phase is not Phase.DRAINING:
            lost = self.resizing.lost(task, event)
            decision = lost or self.resizing.held_out(task, decision)
        if decision.action is Action.RESTART:
            self.restarts.last_fingerprint = event.fingerprint
        self.journal.exited(task, state, how, decision)
        return self._apply(task, event, decision, how)

    def _on_saved(self, task: Task, code: int) -> RunResult | None:
        """A task exited after the stop notice: saved (its status says where), or not."""
        task.ending = EventKind.PREEMPTED
        event = TaskEvent(task.name, task.plan.role, code, kind=EventKind.PREEMPTED)
        decision = self._decide(event)
        status = self.notices.saved(task)
        saved = {k: status.get(k) for k in (contract.SAVED_STEP, contract.SAVE_S)} if status else {}
        if code == 0:
            state = TaskState.SUCCEEDED
        elif decision.action is not Action.STOP or code == -signal.SIGTERM:
            state = TaskState.STOPPED  # it saved, or the notice's SIGTERM ended it: a stop
        else:
            state = TaskState.FAILED
        how = exit_description(code)
        self.journal.exited(task, state, how, decision, **saved)
        return self._apply(task, event, decision, how)

    def on_lapse(self, lapse: Lapse) -> RunResult | None:
        """A deadline passed (a startup, formation or run time limit, a hang, the drain's end):
        the policy decides; a hung task is killed first, then treated like a failed one."""
        task = lapse.task
        if lapse.kind is EventKind.HUNG:
            self.crew.kill([task])
            task.exit_code, task.ending = -signal.SIGKILL, EventKind.HUNG
        event = TaskEvent(task.name, task.plan.role, None, kind=lapse.kind, detail=lapse.how)
        decision = self._decide(event)
        if lapse.kind is EventKind.HUNG:
            self.journal.hung(task, lapse.how, decision, lapse.silent_s, lapse.where)
        elif lapse.kind is EventKind.DRAINED and decision.action is Action.DONE:
            for alive in self.crew.alive():
                self.stop([alive], decision.reason)
        return self._apply(task, event, decision, lapse.how, where=lapse.where)

    def on_save_due(self, unsaved: list[Task]) -> RunResult | None:
        """The stop notice's deadline (timeouts.save_s) passed with ``unsaved`` still running:
        the policy stops the run, naming every such task, or ends it preempted."""
        how = (
            f"did not save within {self.timeouts.save_s:g} s of the stop notice "
            f"({self.notices.save_why}); not saved: {', '.join(t.name for t in unsaved)}"
        )
        first = unsaved[0]
        event = TaskEvent(
            first.name, first.plan.role, None, kind=EventKind.SAVE_TIMEOUT, detail=how
        )
        if self.notices.current is not None and self.notices.current.resize:
            assert self.resizing is not None
            self.console.say(how)
            self.resizing.after_save(saved=False)
            return None
        decision = self._decide(event)
        if decision.action is Action.STOP:
            return self._late_save(unsaved, decision)
        return self._apply(first, event, decision, how)

    def _late_save(self, unsaved: list[Task], missed: Decision) -> RunResult | None:
        """The save missed timeouts.save_s: the tasks get timeouts.grace_s more (SIGTERM, which
        a task that took the notice takes as that notice again, then SIGKILL). The policy then
        hears each one's exit as after any notice: a save that ended in the grace counts."""
        grace = self.timeouts.grace_s
        self.console.say(
            f"{missed.reason}: stopping the run (timeouts.grace_s: {grace:g} s for a save "
            "under way to end)"
        )
        self.stop(self.crew.alive(), missed.reason)
        decision, last = missed, unsaved[-1]
        for task in unsaved:
            assert task.exit_code is not None
            last = task
            event = TaskEvent(task.name, task.plan.role, task.exit_code, kind=EventKind.PREEMPTED)
            decision = self._decide(event)
            if decision.action is Action.STOP:
                break
        if decision.action is Action.PREEMPTED:
            saved = self.notices.preemption()
            return RunResult(RunState.PREEMPTED, None, replace(saved, late=True))
        if decision.action is Action.DONE:
            return self._done(cut=decision.reason)
        self.console.say(f"{last.name} did not save in time: {self.notices.what_was_saved()}")
        raise self.notices.stopped(missed.reason)

    # ---- carrying decisions out -------------------------------------------------------------

    def _apply(
        self,
        task: Task,
        event: TaskEvent,
        decision: Decision,
        how: str,
        where: tuple[str, ...] = (),
    ) -> RunResult | None:
        """Carry out the policy's decision about ``event`` of ``task`` (recorded by the caller).

        A decision of the next round (a resize: the gang again at another world size) is carried
        out here too, by `Restarts` with the plan of the new size.
        """
        action = decision.action
        resize = self.notices.current is not None and self.notices.current.resize
        if resize and action in (Action.PREEMPTED, Action.STOP):
            assert self.resizing is not None
            self.resizing.after_save(saved=action is Action.PREEMPTED)
            return None
        if action is Action.RESIZE:
            assert self.resizing is not None
            self.resizing.apply(decision, self._unkeepable())
            return None
        if action is Action.DONE:
            return self._done(cut=decision.reason if self.notices.current is not None else "")
        if action is Action.PREEMPTED:
            notice = self.notices.current
            if notice is not None and event.kind is EventKind.SAVE_TIMEOUT:
                # Nothing trained in this attempt: it ends where it resumed.
                self.console.say(decision.reason)
                mark_stop_now(self.run_dir, self.attempt)
                self.stop(self.crew.alive(), "the run was preempted")
                return RunResult(RunState.PREEMPTED, None, Preemption(notice.step, None))
            self.stop(self.crew.alive(), "the run was preempted")
            return RunResult(RunState.PREEMPTED, None, self.notices.preemption())
        if action is Action.STOP:
            self.console.say(
                f"{decision.reason}: stopping the run; {self.notices.what_was_saved()}"
            )
            raise self.notices.stopped(decision.reason)
        if action is Action.FAIL:
            failure = self.exits.failure(task, event, decision, how, where)
            return RunResult(RunState.FAILED, failure)
        if action is Action.RESTART:
            delay = f" in {decision.delay_s:g} s" if decision.delay_s else ""
            self.console.say(decision.reason + delay)
            self.restarts.schedule(decision, event.manual)
        return None

    def on_membership(self, now: float) -> RunResult | None:
        """An elastic run's turn (`Resizing.tick`): the world's answer carried out, if any."""
        assert self.resizing is not None
        answer = self.resizing.tick(now)
        if answer is None:
            return None
        world = self.resizing.world
        task = self.crew.tasks.get(world.cause) or next(iter(self.crew))
        event = TaskEvent(task.name, task.plan.role, task.exit_code)
        if answer.verdict is Verdict.FAIL:
            how = "was left without the workers elastic.workers needs"
            decision = Decision(Action.FAIL, answer.reason, note=answer.reason, cause=task.name)
            return self._apply(task, event, decision, how)
        world.pending = answer
        if answer.verdict is not Verdict.RESTART_SAME:
            return self._apply(
                task, event, Decision(Action.RESIZE, answer.reason, answer.slots), ""
            )
        decision = self.resizing.held_out(task, self._decide(event))  # the restart budget
        if decision.action is Action.RESTART:
            world.pending, world.down = None, False
        return self._apply(task, event, decision, "")

    def _done(self, cut: str = "") -> RunResult | None:
        """Training succeeded: stop the servers; give a running evaluator time to finish. After
        the drain (the evaluator finished, or its time ran out) the run has succeeded.

        ``cut``: why the run ends now (a stop notice after training was done): whatever still
        runs is stopped, an evaluator's drain included, and the run has succeeded."""
        alive = self.crew.alive()
        if cut:
            cut_short = [t.name for t in alive if not t.training]
            more = f"; {', '.join(cut_short)} cut short of its drain" if cut_short else ""
            self.console.say(f"stop notice: {cut}: the run succeeded{more}")
            self.stop(alive, cut)
            if self.notices.current is not None:
                self.journal.notice_ended(done=cut)
            return RunResult(RunState.SUCCEEDED, None)
        if self.phase is Phase.DRAINING:
            return RunResult(RunState.SUCCEEDED, None)
        self.standbys.close()  # nothing will restart now
        evaluators = [t for t in alive if not t.training]
        self.stop([t for t in alive if t.training], "training is done")
        if evaluators and self.timeouts.evaluator_drain_s > 0:
            self.deadlines.drain(time.monotonic())
            self.restarts.cancel()
            return None
        return RunResult(RunState.SUCCEEDED, None)

    def stop(self, tasks: list[Task], reason: str) -> None:
        """Stop tasks the polite way (SIGTERM, timeouts.grace_s, SIGKILL): STOPPED for ``reason``."""
        self.crew.stop(tasks, TaskState.STOPPED, reason, self.timeouts.grace_s)
