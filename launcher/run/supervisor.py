"""The supervisor: starts a plan's tasks, watches them in one event loop, and ends the run.

One thread, one `select` over: every task's exit fd (a pidfd: an exit is seen the moment it
happens), a self-pipe that signal handlers write to (Ctrl-C, SIGTERM and `distlaunch restart`'s
SIGUSR1 are handled between events, never in the middle of bookkeeping), and a short timeout that
pumps the tasks' logs to the terminal and checks deadlines, heartbeats and due restarts.

A stop notice (SIGTERM or SIGUSR2 to the launcher: `distlaunch down`, Slurm's `--signal`, a
container stop) is not a stop: it is a NOTICE event, and the policy says what it means. The
first is sent to every training task's program (the transport's `notify`) and the policy hears
each exit as a PREEMPTED event; when all have saved (or finished), the run ends PREEMPTED, else,
at the first task that exits unsaved, it is stopped as a signal stops it (Interrupted). A task
still starting (no "ready" in its status: importing TensorFlow, building the strategy, where a
SIGTERM would kill it) gets its notice held until it can take it. At timeouts.save_s the tasks
still saving get timeouts.grace_s more (SIGTERM, which they take as the notice they already
have, then SIGKILL): a save that ends then still counts, reported late; the others are named.
A second notice joins the save under way (and says which step, since when); a third, Ctrl-C,
or a notice the run cannot keep stops at once. A notice after training was done ends the run
succeeded (an evaluator still draining is cut). When the run ends, the ``ckpt-N_temp/`` folders
of saves cut short are removed.

What an event means is not decided here: every ending of a task or of the run (an exit, a hang,
a restart request, a deadline, a cluster that never formed, the evaluator's drain) becomes a
`TaskEvent` that the RestartPolicy answers with CONTINUE, DONE, RESTART or FAIL; the supervisor
carries it out and logs the decision with its reason. Tasks are reached
only through the `transports.base` interface, and every state change goes through the task's
`state.TaskLedger`, which records it, logs it and saves run.json in one call.

Warm standbys (launcher/transports/local/standby.py) are tended here because only the loop knows
when the cluster has settled and which attempt comes next: STANDBY_DELAY_S after the last task
joined, with no restart pending, the standbys are made (or remade) for the next attempt; they go
when training is done and at teardown.
"""

from __future__ import annotations

import os
import selectors
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from distlaunch.launcher.core.console import Console, LogFollower
from distlaunch.launcher.core.errors import Interrupted
from distlaunch.launcher.diagnosis.oom import OomKills
from distlaunch.launcher.diagnosis.watchdog import Sample, Watchdog
from distlaunch.launcher.plan.plan import Plan, TaskPlan, for_attempt
from distlaunch.launcher.record import rundir
from distlaunch.launcher.record.endings import EventKind
from distlaunch.launcher.record.state import RunBook, RunRecord, RunState, TaskLedger, TaskState
from distlaunch.launcher.run.policy import (
    Action,
    Cluster,
    Decision,
    History,
    RestartPolicy,
    RestartRules,
    TaskEvent,
)
from distlaunch.launcher.spec.model import Restart, Timeouts
from distlaunch.launcher.transports.base import (
    StandbyPool,
    TaskHandle,
    Transport,
    exit_description,
)
from distlaunch.worker import contract

if TYPE_CHECKING:
    from distlaunch.launcher.diagnosis import evidence, stacks
    from distlaunch.launcher.diagnosis.summary import Failure

# What only a run's events and its end use (the evidence of a failure and its summary, the
# tasks' stacks, the cluster's formation, the live progress line, the checkpoint index) is
# imported by the methods that use it: loaded with this module, it would delay every run's
# first task (bench/startup.py; tests/test_cli.py keeps it off that path).

# How often logs are echoed and deadlines checked while nothing else happens.
PUMP_INTERVAL_S = 0.05
# How often joins and heartbeats are checked.
CHECK_INTERVAL_S = 0.25
# How often the live progress line of a terminal is redrawn from the tasks' heartbeats.
LIVE_INTERVAL_S = 1.0
# How long the cluster must have been settled (every task joined) before standbys are made: their
# imports would compete for the CPU with the tasks' own start (model build, restore, first step).
STANDBY_DELAY_S = 5.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, rundir.PRE_TIMEOUT_SIGNAL)
# The stop signals that are a stop notice (see the module docstring) while none is under way.
NOTICE_SIGNALS = (signal.SIGTERM, rundir.PRE_TIMEOUT_SIGNAL)


@dataclass(frozen=True)
class Preemption:
    """What a preempted run saved: the step of its checkpoint (None: the program saved on its
    own, or had no checkpoint dir) and the longest save, from the tasks' status files."""

    step: int | None
    save_s: float | None
    late: bool = False  # the save ended after timeouts.save_s, in the grace period


@dataclass(frozen=True)
class RunResult:
    """How a run ended."""

    state: RunState  # SUCCEEDED, FAILED or PREEMPTED
    failure: Failure | None
    preemption: Preemption | None = None


@dataclass(frozen=True)
class _Notice:
    """A stop notice under way: the signal that brought it and when its save is due."""

    signum: int
    deadline: float  # time.monotonic()
    send: Callable[[list[TaskHandle]], bool]  # the transport's notify
    at: float  # time.monotonic() of the notice
    step: int | None  # the latest checkpoint's step when it came (the checkpoint index's)


class _Task:
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
        return self.plan.name

    @property
    def alive(self) -> bool:
        return self.handle is not None and self.exit_code is None


class Supervisor:
    """Runs a plan to its end: success, a failure the policy will not restart, a timeout or a signal."""

    def __init__(
        self,
        plan: Plan,
        record: RunRecord,
        console: Console,
        timeouts: Timeouts,
        transport: Transport,
        restart: Restart | None = None,
        standbys: StandbyPool | None = None,
        save_why: str | None = None,
    ) -> None:
        self.plan = plan
        # What set timeouts.save_s, for the notice's lines: a bound of the notice's source
        # (``save_why``), else the spec.
        self.save_why = save_why or "timeouts.save_s"
        self.run_dir = Path(plan.run_dir)
        self.book = RunBook(self.run_dir, record, console.say)
        self.console = console
        self.timeouts = timeouts
        self.transport = transport
        roles: dict[str, list[str]] = {}
        for task in plan.tasks:
            roles.setdefault(task.role, []).append(task.name)
        self.policy = RestartPolicy(Cluster(plan.strategy, roles), _rules(restart or Restart()))
        self.attempt = plan.attempt
        self.tasks = {
            t.name: _Task(t, i, self.book.ledger(t.name, t.role, t.index, t.port))
            for i, t in enumerate(plan.tasks)
        }
        self.width = max(len(t.name) for t in plan.tasks)
        self.restart_times: list[float] = []
        self.peer_lost: set[str] = set()  # tasks of this attempt that exited with a follow-on error
        self.last_fingerprint: str | None = None  # the traceback behind the latest restart
        self.watchdog = Watchdog()
        self._oom = OomKills()  # counts the kernel's OOM kills from here on
        self._programs: dict[str, int] = {}  # task -> its program's pid (see _program)
        self.stacks_dir = ""  # the folder of the latest stacks capture
        self.pending: list[tuple[float, tuple[str, ...]]] = []  # (due time, tasks) restarts
        self.drain_until: float | None = None
        self.run_started = 0.0
        self.standbys = standbys
        self.settled_since = 0.0  # time.monotonic() of the latest task start or join
        self._formation_seen = -1.0  # the settled_since whose cluster formation was checked
        self._standbys_for: int | None = None  # the attempt the standbys were last made for
        self._signals: list[int] = []
        self.notice: _Notice | None = None
        self._notices = 0  # stop notices so far
        # Training tasks whose notice is held until they can take it (see _takes_notice).
        self._held: set[str] = set()
        self._sel = selectors.DefaultSelector()
        self._next_check = self._next_live = 0.0  # when the loop checks deadlines, redraws

    @property
    def record(self) -> RunRecord:
        """The run's record, as run.json has it."""
        return self.book.record

    # ---- the loop -------------------------------------------------------------------------

    def run(self) -> RunResult:
        """Start every task, supervise until the run ends, and always tear everything down."""
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sel.register(wake_r, selectors.EVENT_READ, None)
        watched = (*STOP_SIGNALS, rundir.CONTROL_SIGNAL)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in watched}
        previous_fd = signal.set_wakeup_fd(wake_w)
        try:
            self.run_started = time.monotonic()
            with self.book.batch():
                for task in self.plan.tasks:
                    self._check_stop_signals()
                    self._start(task)
            result = self._loop(wake_r)
        finally:
            self._teardown()
            signal.set_wakeup_fd(previous_fd)
            for sig, handler in previous.items():
                if self.notice is not None and sig in NOTICE_SIGNALS:
                    # A notice that comes now (a second `down` as the run ends) has nothing
                    # left to save: it must not turn the launcher's exit code (75) into a death
                    # by SIGTERM. The supervisor runs in a launcher process (the CLI's, the
                    # API's child), which exits once the run's end is recorded.
                    handler = signal.SIG_IGN
                signal.signal(sig, handler)
            self._sel.close()
            os.close(wake_r)
            os.close(wake_w)
        return result

    def _on_signal(self, signum: int, _frame: object) -> None:
        # Only note it: the loop wakes up through the wakeup fd and acts between events.
        self._signals.append(signum)

    def _loop(self, wake_r: int) -> RunResult:
        while True:
            more = False
            for task in self.tasks.values():
                if task.follower is not None:
                    more |= task.follower.pump()
            self.console.out.flush()
            ready = []
            for key, _ in self._sel.select(0 if more else self._select_timeout()):
                if key.data is None:
                    _drain(wake_r)
                    continue
                ready.append(key)
            # One save of run.json for all that this turn changed: a save per event would write
            # the whole record once per task (256 tasks joining: 256 saves of all 256 entries).
            with self.book.batch():
                result = self._turn(ready)
            if result is not None:
                return result

    def _turn(self, ready: list[selectors.SelectorKey]) -> RunResult | None:
        """Handle one turn of the loop: the exits seen, signals, due restarts and checks."""
        from distlaunch.launcher.diagnosis import evidence

        # Exits seen together: a task's own failure is handled before its peers' follow-on
        # errors, so that the root cause is the task that died, not a survivor.
        ready.sort(key=lambda k: evidence.peer_lost(self._evidence(k.data.plan)))
        for key in ready:
            if self._sel.get_map().get(key.fd) is not key:
                # An earlier exit of this batch already dealt with this task (a gang restart
                # killed it): its exit is recorded, and its fd is no longer watched.
                continue
            self._sel.unregister(key.fd)
            result = self._on_exit(key.data)
            if result is not None:
                return result
        result = self._check_signals()
        if result is not None:
            return result
        now = time.monotonic()
        result = self._start_due_restarts(now)
        if result is None and now >= self._next_check:
            self._next_check = now + CHECK_INTERVAL_S
            result = self._check_deadlines(now)
            if result is None:
                self._tend_standbys(now)
        if self.console.live and now >= self._next_live:
            from distlaunch.launcher.diagnosis.progress_view import live_line, task_progress

            self._next_live = now + LIVE_INTERVAL_S
            rows = task_progress(self.run_dir, self.record)
            self.console.show_live(live_line(rows))
        return result

    def _select_timeout(self) -> float:
        timeout = PUMP_INTERVAL_S
        if self.pending:
            due = min(due for due, _ in self.pending)
            timeout = min(timeout, max(0.0, due - time.monotonic()))
        return timeout

    def _check_stop_signals(self) -> None:
        """While tasks start: a stop signal stops at once; a notice waits for the loop (it is
        held for the tasks that cannot take it yet)."""
        stops = [s for s in self._signals if s in STOP_SIGNALS and s not in NOTICE_SIGNALS]
        if stops:
            raise Interrupted(stops[0])

    def _check_signals(self) -> RunResult | None:
        while self._signals:
            signum = self._signals.pop(0)
            if signum in NOTICE_SIGNALS:
                result = self._on_notice(signum)
            elif signum in STOP_SIGNALS:
                raise Interrupted(signum)
            else:
                result = self._on_control_requests()
            if result is not None:
                return result
        return None

    def _on_notice(self, signum: int) -> RunResult | None:
        """A stop notice: the policy sends it, joins the one under way, or ends the run."""
        name = signal.Signals(signum).name
        event = TaskEvent("run", "", None, kind=EventKind.NOTICE, detail=name)
        decision = self._decide(event)
        self._notices += 1
        if decision.action is Action.NOTIFY:
            self._notify(signum)
            return None
        if decision.action is Action.CONTINUE:
            assert self.notice is not None
            self._join(name)
            return None
        if decision.action is Action.DONE:
            self.book.event("run", "notice", self.attempt, signal=name, reason=decision.reason)
            self.record.notice = {"signal": name, "at": time.time(), "done": decision.reason}
            return self._done(cut=decision.reason)
        if self.notice is not None:
            self.console.say(f"{decision.reason}: stopping the run")
            self._notice_ended(stopped=decision.reason)
        # Else the notice cannot be kept (the program cannot save on one, a task is down
        # waiting to restart): the run stops at once, as it always did.
        raise Interrupted(signum)

    def _notify(self, signum: int) -> None:
        """Send every running training task a stop notice, or hold it for those still starting."""
        from distlaunch.launcher.record import checkpoints

        notify = self.transport.notify  # type: ignore[attr-defined]  # the policy checked it
        savers = [t for n in self.policy.cluster.savers() if (t := self.tasks[n]).alive]
        self._held = {t.name for t in savers if not self._takes_notice(t)}
        now = time.monotonic()
        save_s = self.timeouts.save_s
        index = checkpoints.latest(contract.checkpoint_dir(self.run_dir))
        self.notice = _Notice(signum, now + save_s, notify, now, index.step if index else None)
        ready = [t.handle for t in savers if t.name not in self._held]
        if ready and not notify(ready):
            self.console.say("the transport cannot deliver a stop notice: stopping the run")
            raise Interrupted(signum)
        if self.standbys is not None:
            self.standbys.close()  # nothing restarts after a notice
            self._record_standbys()
        name = signal.Signals(signum).name
        held = ""
        if self._held:
            held = (
                f"; {', '.join(sorted(self._held))} still starting: "
                "its notice waits until it can take it"
            )
        self.console.say(
            f"stop notice ({name}): asking {len(savers)} tasks to save and stop within "
            f"{save_s:g} s ({self.save_why}){held}"
        )
        self.record.notice = {"signal": name, "at": time.time(), "save_s": save_s}
        self.book.save()
        self.book.event(
            "run", "notice", self.attempt, signal=name, save_s=save_s, held=sorted(self._held)
        )

    def _join(self, name: str) -> None:
        """A second notice: the save under way goes on; say which step, since when."""
        assert self.notice is not None
        step = self._saving_step()
        since = time.monotonic() - self.notice.at
        left = max(0.0, self.notice.deadline - time.monotonic())
        at = f"step {step}" if step is not None else "its tasks"
        self.console.say(
            f"stop notice again ({name}): saving {at}, started {since:.0f} s ago, due within "
            f"{left:.0f} s; joining it (Ctrl-C or `distlaunch down --now` stops without saving)"
        )
        self.book.event("run", "notice", self.attempt, signal=name, joined=True)

    def _saving_step(self) -> int | None:
        """The step the savers are saving, or the latest they reported (their status files)."""
        steps = []
        for name in self.policy.cluster.savers():
            status = self._status_of(self.tasks[name])
            step = status.get(contract.SAVED_STEP, status.get("step"))
            if isinstance(step, int):
                steps.append(step)
        return max(steps) if steps else None

    def _takes_notice(self, task: _Task) -> bool:
        """Whether the task's program can take a notice now: distlaunch's or the program's own
        handler is in (status "ready" or later: dw.strategy() built the strategy); or, for a
        program that reports no status, its TensorFlow server is up. Before that (importing
        TensorFlow, building the strategy) a SIGTERM would kill it, or TensorFlow's own handler
        would swallow it (worker/preempt.py)."""
        state = self._status_of(task).get("state")
        if state is not None:
            return state != contract.STATE_STARTING
        assert task.handle is not None
        return task.ledger.state is TaskState.RUNNING or task.handle.joined()

    def _notice_ended(self, **how: object) -> None:
        """Record how the notice ended in run.json (`distlaunch down` reports it)."""
        self.record.notice = {**(self.record.notice or {}), **how}
        self.book.save()

    # ---- events ---------------------------------------------------------------------------

    def _exited(self) -> dict[str, int]:
        """Each task that has ended in the current attempt, and how."""
        return {n: t.exit_code for n, t in self.tasks.items() if t.exit_code is not None}

    def _decide(self, event: TaskEvent) -> Decision:
        history = History(
            tuple(self.restart_times), frozenset(self.peer_lost), self.last_fingerprint
        )
        if event.kind in (EventKind.NOTICE, EventKind.PREEMPTED, EventKind.SAVE_TIMEOUT):
            history = replace(
                history,
                notices=self._notices,
                training_done=self._training_done(),
                unkeepable=self._unkeepable() if event.kind is EventKind.NOTICE else "",
                held=frozenset(n for n in self._held if self.tasks[n].alive),
            )
        return self.policy.decide(event, self._exited(), history, time.monotonic())

    def _training_done(self) -> bool:
        """Whether this attempt's training is done: the evaluator's drain is under way, or the
        chief wrote the "training done" marker (contract.training_done_path)."""
        if self.drain_until is not None:
            return True
        marker = rundir.read_json(contract.training_done_path(self.run_dir))
        return isinstance(marker, dict) and marker.get("attempt") == self.attempt

    def _unkeepable(self) -> str:
        """Why a stop notice cannot be kept now ("" when it can)."""
        if not self.plan.program.saves_on_notice:
            # program_scan: no dw.fit, no TensorFlow or Keras handler; it stops as it always did
            return "the program cannot save on a stop notice"
        if getattr(self.transport, "notify", None) is None:
            return "the transport cannot deliver a stop notice"
        if self.pending:
            return "a task is down, waiting to restart"
        return ""

    def _on_exit(self, task: _Task) -> RunResult | None:
        from distlaunch.launcher.diagnosis import evidence

        assert task.handle is not None and task.follower is not None
        code = task.handle.exit_status()  # its exit fd is readable: it has exited, this reaps it
        assert code is not None, f"{task.name}: exit fd readable but no exit status"
        task.exit_code = code
        task.follower.close()
        how = exit_description(code)
        state = TaskState.SUCCEEDED if code == 0 else TaskState.FAILED
        ended = {"exit_code": code, "exit": how, "ended_at": time.time()}
        task.ending = EventKind.EXITED
        if self.notice is not None:
            return self._on_exit_after_notice(task, code, how, ended)
        if self.drain_until is not None:
            # Training already succeeded; the evaluator has now finished too.
            why = "the evaluator finished after training"
            event = TaskEvent(task.name, task.plan.role, code, kind=EventKind.DRAINED, detail=why)
            decision = self._decide(event)
            task.ledger.change(
                state, "exited", ended, exit=how, exit_code=code,
                decision=decision.action.value, reason=decision.reason,
            )  # fmt: skip
            return self._apply(task, event, decision, how)
        if code != 0:
            oom = self._oom.kill_of(self._program(task), code, self.watchdog.rss.get(task.name))
            if oom:
                how = ended["exit"] = oom
        found = self._evidence(task.plan) if code != 0 else None
        lost = evidence.peer_lost(found)
        if lost:
            self.peer_lost.add(task.name)
        # A follow-on error repeats whenever a peer dies (a chaos test kills one again and again):
        # only a task's own traceback can make a crash loop.
        fingerprint = None if lost else evidence.fingerprint(found)
        event = TaskEvent(
            task.name, task.plan.role, code, self._error_type(task.plan), peer_lost=lost,
            fingerprint=fingerprint, lost_peers=evidence.lost_tasks(found) if lost else (),
        )  # fmt: skip
        decision = self._decide(event)
        if decision.action is Action.RESTART:
            self.last_fingerprint = fingerprint
        task.ledger.change(
            state,
            "exited",
            ended,
            decision=decision.action.value,
            reason=decision.reason,
            exit=how,
            exit_code=code,
        )
        return self._apply(task, event, decision, how)

    def _on_exit_after_notice(
        self, task: _Task, code: int, how: str, ended: dict
    ) -> RunResult | None:
        """A task exited after the stop notice: saved (its status says where), or not."""
        task.ending = EventKind.PREEMPTED
        event = TaskEvent(task.name, task.plan.role, code, kind=EventKind.PREEMPTED)
        decision = self._decide(event)
        status = self._saved_status(task)
        saved = {k: status.get(k) for k in (contract.SAVED_STEP, contract.SAVE_S)} if status else {}
        if code == 0:
            state = TaskState.SUCCEEDED
        elif decision.action is not Action.STOP or code == -signal.SIGTERM:
            state = TaskState.STOPPED  # it saved, or the notice's SIGTERM ended it: a stop
        else:
            state = TaskState.FAILED
        task.ledger.change(
            state, "exited", ended, decision=decision.action.value, reason=decision.reason,
            exit=how, exit_code=code, **saved,
        )  # fmt: skip
        return self._apply(task, event, decision, how)

    def _on_hang(
        self, task: _Task, how: str, where: tuple[str, ...], silent_s: float
    ) -> RunResult | None:
        """A task stopped making progress: stop it, then treat it like a failed task."""
        self._kill([task])
        task.exit_code = -signal.SIGKILL
        task.ending = EventKind.HUNG
        event = TaskEvent(task.name, task.plan.role, None, kind=EventKind.HUNG, detail=how)
        decision = self._decide(event)
        ended = {"exit": how, "ended_at": time.time()}
        task.ledger.change(
            TaskState.FAILED,
            "hung",
            ended,
            decision=decision.action.value,
            reason=decision.reason,
            silent_s=round(silent_s, 1),
            stacks=list(where),
        )
        return self._apply(task, event, decision, how, where=where)

    def _on_silence(self, task: _Task, silent_s: float) -> RunResult | None:
        """No task output, heartbeat or CPU for silence_s: capture where every task is, then
        report the silent task stuck in its own code (the others wait in TensorFlow for it)."""
        from distlaunch.launcher.diagnosis import stacks

        captures = self._capture_stacks()
        # Who may be named hung: the tasks silent for most of the window too (the hung one went
        # quiet around when its peers blocked on it); a task that printed or beat since works.
        now, half = time.monotonic(), (self.timeouts.silence_s or 0) / 2
        silent = {task.name} | {
            t.name
            for t in self.tasks.values()
            if t.alive and self.watchdog.silent_for(t.name, now) > half
        }
        stuck = stacks.hung(captures, silent)
        culprit = self.tasks[stuck[0].task] if stuck else task
        how = (
            f"hung: no log output, heartbeat or CPU progress for {silent_s:.0f} s "
            "(timeouts.silence_s)"
        )
        where = tuple(stacks.summary(captures, silent=True, among=silent))
        return self._on_hang(culprit, how, where, silent_s)

    def _capture_stacks(self) -> list[stacks.Capture]:
        """Every running task's stacks, into RUN/stacks/<time>/ (Python frames: fast), each read
        where the task runs, as its transport says."""
        from distlaunch.launcher.diagnosis import stacks

        sources = {
            t.name: self.transport.stacks(t.handle, native=False)
            for t in self.tasks.values()
            if t.alive and t.handle is not None
        }
        if not sources:
            return []
        self.console.say(f"capturing the stacks of {', '.join(sources)}")
        try:
            captures = stacks.capture(self.run_dir, sources)
        except (OSError, stacks.StackError) as exc:
            self.console.say(f"could not capture stacks: {exc}")
            return []
        self.stacks_dir = str(captures[0].file.parent) if captures else ""
        return captures

    def _stacks_where(self, silent: bool = False) -> tuple[str, ...]:
        """Every running task's stacks captured (`_capture_stacks`), one line each."""
        from distlaunch.launcher.diagnosis import stacks

        return tuple(stacks.summary(self._capture_stacks(), silent=silent))

    def _program(self, task: _Task) -> int:
        """The pid of the task's program (below taskinit's keeper), found once it exists."""
        assert task.handle is not None
        keeper = task.handle.pid
        found = self._programs.get(task.name)
        if found is None or found == keeper:
            from distlaunch.launcher.diagnosis import stacks

            found = self._programs[task.name] = stacks.program_pid(keeper)
        return found

    def _on_control_requests(self) -> RunResult | None:
        for name in rundir.take_restart_requests(self.run_dir):
            if name not in self.tasks:
                continue
            task = self.tasks[name]
            event = TaskEvent(name, task.plan.role, None, kind=EventKind.MANUAL)
            decision = self._decide(event)
            task.ledger.note(
                "restart-requested", decision=decision.action.value, reason=decision.reason
            )
            result = self._apply(task, event, decision, "")
            if result is not None:
                return result
        return None

    def _apply(
        self,
        task: _Task,
        event: TaskEvent,
        decision: Decision,
        how: str,
        where: tuple[str, ...] = (),
    ) -> RunResult | None:
        """Carry out the policy's decision about ``event`` of ``task`` (logged by the caller)."""
        if decision.action is Action.DONE:
            return self._done(cut=decision.reason if self.notice is not None else "")
        if decision.action is Action.PREEMPTED:
            alive = [t for t in self.tasks.values() if t.alive]
            if self.notice is not None and event.kind is EventKind.SAVE_TIMEOUT:
                # Nothing trained in this attempt: it ends where it resumed.
                self.console.say(decision.reason)
                _mark_stop_now(self.run_dir, self.attempt)
                self._stop(alive, TaskState.STOPPED, "the run was preempted")
                return RunResult(RunState.PREEMPTED, None, Preemption(self.notice.step, None))
            self._stop(alive, TaskState.STOPPED, "the run was preempted")
            return RunResult(RunState.PREEMPTED, None, self._preemption())
        if decision.action is Action.STOP:
            assert self.notice is not None
            self.console.say(f"{decision.reason}: stopping the run; {self._what_was_saved()}")
            self._notice_ended(stopped=decision.reason)
            raise Interrupted(self.notice.signum)
        if decision.action is Action.FAIL:
            return RunResult(RunState.FAILED, self._fail(task, event, decision, how, where))
        if decision.action is Action.RESTART:
            delay = f" in {decision.delay_s:g} s" if decision.delay_s else ""
            self.console.say(decision.reason + delay)
            self._schedule_restart(decision, event.manual)
        return None

    def _fail(
        self,
        task: _Task,
        event: TaskEvent,
        decision: Decision,
        how: str,
        where: tuple[str, ...],
    ) -> Failure:
        """The failure to report: the decision's cause (not a survivor that only lost a peer)."""
        note = decision.note
        if decision.cause == task.name:
            return self._failure(task, how, note, where, event.kind, event.returncode)
        follow_on = f"{task.name} {how} with a follow-on error: peer lost"
        if decision.cause is None:
            # Nobody has died on their own (yet): the stacks of the others show who is stuck.
            where = self._stacks_where()
            note = "; ".join(x for x in ("peer lost: no other task had failed", note) if x)
            return self._failure(task, how, note, where, event.kind, event.returncode)
        cause = self.tasks[decision.cause]
        if cause.alive:
            # Named lost by its peers but still there (frozen, or cut off): show where it is.
            where = self._stacks_where()
            cause_how = "stopped answering its peers (its process was still there)"
            kind, code = EventKind.HUNG, None
        else:
            cause_how = str(cause.ledger.entry.exit or "failed")
            kind = cause.ending
            code = cause.exit_code if kind is EventKind.EXITED else None
        note = "; ".join(x for x in (note, follow_on) if x)
        return self._failure(cause, cause_how, note, where, kind, code)

    def _done(self, cut: str = "") -> RunResult | None:
        """Training succeeded: stop the servers; give a running evaluator time to finish. After
        the drain (the evaluator finished, or its time ran out) the run has succeeded.

        ``cut``: why the run ends now (a stop notice after training was done): whatever still
        runs is stopped, an evaluator's drain included, and the run has succeeded."""
        if cut:
            alive = [t for t in self.tasks.values() if t.alive]
            cut_short = [t.name for t in alive if t.plan.role == contract.EVALUATOR]
            more = f"; {', '.join(cut_short)} cut short of its drain" if cut_short else ""
            self.console.say(f"stop notice: {cut}: the run succeeded{more}")
            self._stop(alive, TaskState.STOPPED, cut)
            if self.notice is not None:
                self._notice_ended(done=cut)
            return RunResult(RunState.SUCCEEDED, None)
        if self.drain_until is not None:
            return RunResult(RunState.SUCCEEDED, None)
        if self.standbys is not None:
            self.standbys.close()  # nothing will restart now
            self._record_standbys()
        alive = [t for t in self.tasks.values() if t.alive]
        evaluators = [t for t in alive if t.plan.role == contract.EVALUATOR]
        self._stop([t for t in alive if t not in evaluators], TaskState.STOPPED, "training is done")
        if evaluators and self.timeouts.evaluator_drain_s > 0:
            self.drain_until = time.monotonic() + self.timeouts.evaluator_drain_s
            self.pending.clear()
            return None
        return RunResult(RunState.SUCCEEDED, None)

    # ---- restarts ---------------------------------------------------------------------------

    def _schedule_restart(self, decision: Decision, manual: bool) -> None:
        names = decision.tasks
        # Survivors of a gang are killed at once: they hold no state that the checkpoint does
        # not, and an MWMS worker blocked in a collective would sit out SIGTERM's grace anyway.
        self._kill([self.tasks[n] for n in names if self.tasks[n].alive])
        if not manual:
            self.restart_times.append(time.monotonic())
        self.attempt += 1
        rundir.make_dirs(self.run_dir, self.attempt, private=_is_private(self.run_dir))
        self.record.attempt = self.attempt
        self.pending = [(due, rest) for due, rest in self.pending if not set(rest) & set(names)]
        self.pending.append((time.monotonic() + decision.delay_s, names))
        self.book.save()

    def _start_due_restarts(self, now: float) -> RunResult | None:
        due = [names for when, names in self.pending if when <= now]
        if not due:
            return None
        self.pending = [(when, names) for when, names in self.pending if when > now]
        # Same ports and TF_CONFIG; a new DISTLAUNCH_ATTEMPT, log file and error file.
        plan = for_attempt(self.plan, self.attempt)
        with self.book.batch():
            for names in due:
                for name in names:
                    self._check_stop_signals()
                    restarts = self.tasks[name].ledger.entry.restarts + 1
                    self._start(plan.task(name), restarts=restarts)
        return None

    def _start(self, plan: TaskPlan, restarts: int = 0) -> None:
        task = self.tasks[plan.name]
        if task.follower is not None:
            task.follower.close()
        if task.handle is not None:
            # The previous incarnation is stopped and reaped: release its pidfd (and an SSH
            # client's stdin pipe) before its successor takes its place.
            task.handle.close()
        handle = self.transport.start(plan)
        task.plan, task.handle, task.exit_code, task.ending = plan, handle, None, EventKind.EXITED
        self.peer_lost.discard(plan.name)
        self.watchdog.reset(plan.name)
        self._programs.pop(plan.name, None)
        task.started = self.settled_since = time.monotonic()
        prefix = self.console.prefix(plan.name, task.number, self.width)
        task.follower = LogFollower(plan.log_file, prefix, self.console)
        self._sel.register(handle.exit_fd, selectors.EVENT_READ, task)
        started = {
            "attempt": plan.attempt,
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

    # ---- periodic checks ------------------------------------------------------------------

    def _check_deadlines(self, now: float) -> RunResult | None:
        """The periodic checks, each of which may end a task or the run (through the policy):
        the evaluator's drain once training is done, else each task's, the cluster's formation
        and the run's time limit."""
        if self.drain_until is not None:
            return self._check_drain(now)
        if self.notice is not None:
            # Saving tasks make no progress, nor is a deadline other than the save's theirs now.
            return self._check_save(now)
        wall = time.time()
        for task in self.tasks.values():
            if task.alive and task.plan.role != contract.EVALUATOR:
                result = self._check_task(task, now, wall)
                if result is not None:
                    return result
        return self._check_formation(now) or self._check_run_time(now)

    def _check_task(self, task: _Task, now: float, wall: float) -> RunResult | None:
        """A live training task: has it joined, missed its startup deadline, stopped beating or
        gone silent?"""
        assert task.handle is not None
        if task.ledger.state is TaskState.STARTING:
            if task.handle.joined():
                self.settled_since = now
                joined = {"joined_after_s": round(now - task.started, 3)}
                task.ledger.change(TaskState.RUNNING, "joined", joined, port=task.plan.port)
            elif now - task.started > self.timeouts.startup_s:
                how = (
                    f"did not start its TensorFlow server on port {task.plan.port} "
                    f"within {self.timeouts.startup_s:g} s (timeouts.startup_s)"
                )
                return self._on_deadline(task, EventKind.STARTUP_TIMEOUT, how, capture=True)
        if self.timeouts.heartbeat_s is not None:
            silent = self._silent_for(task, wall)
            if silent is not None and silent > self.timeouts.heartbeat_s:
                where = self._stacks_where(silent=True)
                return self._on_hang(task, f"no heartbeat for {silent:.0f} s", where, silent)
        silent = self.watchdog.observe(task.name, now, self._sample(task))
        if self.timeouts.silence_s is not None and silent > self.timeouts.silence_s:
            return self._on_silence(task, silent)
        return None

    def _check_save(self, now: float) -> RunResult | None:
        """The stop notice's deadline (timeouts.save_s): the policy stops the run if a training
        task is still running by then, naming every such task."""
        assert self.notice is not None
        for name in sorted(self._held):
            task = self.tasks[name]
            if not task.alive:
                self._held.discard(name)
            elif self._takes_notice(task):
                self._held.discard(name)
                if not self.notice.send([task.handle]):
                    self.console.say("the transport cannot deliver a stop notice: stopping")
                    raise Interrupted(self.notice.signum)
        savers = (self.tasks[name] for name in self.policy.cluster.savers())
        unsaved = [t for t in savers if t.alive]
        if now < self.notice.deadline or not unsaved:
            return None
        how = (
            f"did not save within {self.timeouts.save_s:g} s of the stop notice ({self.save_why})"
            f"; not saved: {', '.join(t.name for t in unsaved)}"
        )
        first = unsaved[0]
        event = TaskEvent(
            first.name, first.plan.role, None, kind=EventKind.SAVE_TIMEOUT, detail=how
        )
        decision = self._decide(event)
        if decision.action is Action.STOP:
            return self._late_save(unsaved, decision)
        return self._apply(first, event, decision, how)

    def _late_save(self, unsaved: list[_Task], missed: Decision) -> RunResult | None:
        """The save missed timeouts.save_s: the tasks get timeouts.grace_s more (SIGTERM, which
        a task that took the notice takes as that notice again, then SIGKILL). The policy then
        hears each one's exit as after any notice: a save that ended in the grace counts."""
        grace = self.timeouts.grace_s
        self.console.say(
            f"{missed.reason}: stopping the run (timeouts.grace_s: {grace:g} s for a save "
            "under way to end)"
        )
        alive = [t for t in self.tasks.values() if t.alive]
        self._stop(alive, TaskState.STOPPED, missed.reason)
        decision, last = missed, unsaved[-1]
        for task in unsaved:
            assert task.exit_code is not None
            last = task
            event = TaskEvent(task.name, task.plan.role, task.exit_code, kind=EventKind.PREEMPTED)
            decision = self._decide(event)
            if decision.action is Action.STOP:
                break
        if decision.action is Action.PREEMPTED:
            saved = self._preemption()
            return RunResult(RunState.PREEMPTED, None, replace(saved, late=True))
        if decision.action is Action.DONE:
            return self._done(cut=decision.reason)
        assert self.notice is not None
        self.console.say(f"{last.name} did not save in time: {self._what_was_saved()}")
        self._notice_ended(stopped=missed.reason)
        raise Interrupted(self.notice.signum)

    def _what_was_saved(self) -> str:
        """What a resume would start from, from the checkpoint index (what the tasks saved even
        when they could not say so)."""
        from distlaunch.launcher.record import checkpoints

        assert self.notice is not None
        index = checkpoints.latest(contract.checkpoint_dir(self.run_dir))
        if index is None:
            return "no checkpoint: `up --resume` starts over"
        if self.notice.step is None or index.step > self.notice.step:
            return f"{index.name} was saved after the notice: `up --resume` continues from it"
        return f"nothing saved on the notice: `up --resume` continues from {index.name}"

    def _preemption(self) -> Preemption:
        """The step the training tasks saved (the chief's, which is everyone's) and the longest
        save, from their status files."""
        steps, times = [], []
        for task in self.tasks.values():
            status = self._saved_status(task)
            if status is None:
                continue
            if isinstance(status.get(contract.SAVED_STEP), int):
                steps.append(status[contract.SAVED_STEP])
            if isinstance(status.get(contract.SAVE_S), (int, float)):
                times.append(float(status[contract.SAVE_S]))
        return Preemption(max(steps) if steps else None, max(times) if times else None)

    def _status_of(self, task: _Task) -> dict:
        """The status file of the task's current incarnation; {} when it has written none."""
        plan = task.plan
        status = rundir.read_json(contract.status_path(self.run_dir, plan.role, plan.index))
        if not isinstance(status, dict) or status.get("attempt") != task.ledger.entry.attempt:
            return {}
        return status

    def _saved_status(self, task: _Task) -> dict | None:
        """The task's status file if this incarnation reported saving on the notice."""
        status = self._status_of(task)
        return status if status.get("state") == contract.STATE_PREEMPTED else None

    def _check_run_time(self, now: float) -> RunResult | None:
        """The run's time limit (timeouts.run_s), for the task still running or, when every task
        is down waiting out a backoff, the one waiting to restart."""
        if self.timeouts.run_s is None or now - self.run_started <= self.timeouts.run_s:
            return None
        limit = f"the run hit its time limit of {self.timeouts.run_s:g} s (timeouts.run_s)"
        running = [t for t in self.tasks.values() if t.alive]
        if running:
            how = f"was still running when {limit}"
            return self._on_deadline(running[0], EventKind.RUN_TIMEOUT, how, capture=True)
        waiting = self.tasks[self.pending[0][1][0]]
        how = f"was waiting to restart when {limit}"
        return self._on_deadline(waiting, EventKind.RUN_TIMEOUT, how, capture=False)

    def _check_drain(self, now: float) -> RunResult | None:
        """Training is done: once the evaluator's drain time is out, the policy ends the run and
        whatever still runs is stopped."""
        if now < (self.drain_until or 0.0):
            return None
        drain = self.timeouts.evaluator_drain_s
        why = f"the evaluator did not finish within {drain:g} s (timeouts.evaluator_drain_s)"
        alive = [t for t in self.tasks.values() if t.alive]
        evaluator = next(
            (t for t in alive if t.plan.role == contract.EVALUATOR), alive[0] if alive else None
        )
        if evaluator is None:  # nothing runs any more: nothing to drain
            return RunResult(RunState.SUCCEEDED, None)
        event = TaskEvent(
            evaluator.name, evaluator.plan.role, None, kind=EventKind.DRAINED, detail=why
        )
        decision = self._decide(event)
        if decision.action is Action.DONE:
            for task in alive:
                self._stop([task], TaskState.STOPPED, decision.reason)
        return self._apply(evaluator, event, decision, why)

    def _on_deadline(
        self, task: _Task, kind: EventKind, how: str, capture: bool
    ) -> RunResult | None:
        """A deadline passed for ``task`` (startup_s, formation_s, run_s): the policy decides;
        ``capture``: the stacks of every running task go with the failure."""
        where = self._stacks_where() if capture else ()
        event = TaskEvent(task.name, task.plan.role, None, kind=kind, detail=how)
        return self._apply(task, event, self._decide(event), how, where=where)

    def _check_formation(self, now: float) -> RunResult | None:
        """Once every training task has had its server up for timeouts.formation_s, ask the
        coordination service's log whether they all connected (once per settling: a restart's
        rejoin asks again). A task still missing cannot reach the leader's port."""
        if self._formation_seen == self.settled_since or not self._settled(
            now, self.timeouts.formation_s
        ):
            return None
        from distlaunch.launcher.diagnosis import formation

        self._formation_seen = self.settled_since
        name = formation.leader(list(self.tasks))
        if name is None:
            return None
        leader = self.tasks[name]
        seen = formation.latest(leader.plan.log_file)
        if seen is None or seen.missing == 0:
            return None
        missing = [s for s in seen.stragglers if s in self.tasks] or [name]
        how = (
            f"never connected to the coordination service on {leader.name} "
            f"({leader.plan.address}), {seen.missing} of {seen.total} tasks "
            f"missing {self.timeouts.formation_s:g} s after every task started its server "
            "(timeouts.formation_s): the tasks cannot reach each other's ports (a firewall "
            "between hosts, a container network that drops traffic, a host name that resolves "
            "elsewhere)"
        )
        return self._on_deadline(self.tasks[missing[0]], EventKind.FORMATION, how, capture=True)

    def _tend_standbys(self, now: float) -> None:
        """Once settled, have the standbys of the next attempt; keep run.json's list current."""
        if self.standbys is None:
            return
        self.standbys.poll()
        if self._settled(now, STANDBY_DELAY_S) and self._standbys_for != self.attempt + 1:
            self._standbys_for = self.attempt + 1
            self.standbys.prepare(for_attempt(self.plan, self.attempt + 1).tasks)
        self._record_standbys()

    def _settled(self, now: float, for_s: float) -> bool:
        """Whether every live training task has been joined for ``for_s``, no restart pending and
        training not over."""
        return (
            not self.pending
            and self.drain_until is None
            and now - self.settled_since >= for_s
            and all(
                t.ledger.state is TaskState.RUNNING
                for t in self.tasks.values()
                if t.alive and t.plan.role != contract.EVALUATOR
            )
        )

    def _record_standbys(self) -> None:
        record = (self.standbys.record() if self.standbys is not None else {}) or None
        if record != self.record.standbys:
            self.record.standbys = record
            self.book.save()

    def _sample(self, task: _Task) -> Sample:
        """What the watchdog needs of a task: log size, heartbeat, CPU time and RSS."""
        plan = task.plan
        try:
            log_bytes = os.stat(plan.log_file).st_size
        except OSError:
            log_bytes = 0
        status = rundir.read_json(contract.status_path(self.run_dir, plan.role, plan.index))
        beat = status.get("time") if isinstance(status, dict) else None
        cpu, rss = _cpu_and_rss(self._program(task))
        return Sample(log_bytes, beat if isinstance(beat, (int, float)) else None, cpu, rss)

    def _silent_for(self, task: _Task, wall: float) -> float | None:
        """Seconds since this incarnation's last heartbeat; None before its first one."""
        plan = task.plan
        status = rundir.read_json(contract.status_path(self.run_dir, plan.role, plan.index))
        if not isinstance(status, dict) or status.get("attempt") != task.ledger.entry.attempt:
            return None
        beat = status.get("time")
        return wall - beat if isinstance(beat, (int, float)) else None

    # ---- stopping ---------------------------------------------------------------------------

    def _kill(self, tasks: list[_Task]) -> None:
        """Kill tasks now, through their transport (for restarts: nothing of theirs is worth a grace)."""
        handles = self._unwatch(tasks)
        self.transport.kill(handles)
        with self.book.batch():
            for task in tasks:
                self._ended(task, TaskState.KILLED, "killed", "restarting")

    def _stop(self, tasks: list[_Task], state: TaskState, reason: str) -> None:
        """Stop tasks the polite way: SIGTERM, the grace period, SIGKILL."""
        handles = self._unwatch(tasks)
        self.transport.stop(handles, self.timeouts.grace_s)
        with self.book.batch():
            for task in tasks:
                self._ended(task, state, state.value, reason)

    def _unwatch(self, tasks: list[_Task]) -> list[TaskHandle]:
        handles = []
        for task in tasks:
            assert task.handle is not None
            handles.append(task.handle)
            try:
                self._sel.unregister(task.handle.exit_fd)
            except (KeyError, ValueError):
                pass
        return handles

    def _ended(self, task: _Task, state: TaskState, event: str, reason: str) -> None:
        """Record a task the launcher has just stopped or killed."""
        assert task.handle is not None and task.follower is not None
        code = task.handle.exit_status()
        assert code is not None, f"{task.name}: still running after its transport stopped it"
        task.exit_code = code
        task.follower.close()
        how = exit_description(code)
        ended = {"exit_code": code, "exit": how, "ended_at": time.time()}
        task.ledger.change(state, event, ended, exit=how, reason=reason)

    def _teardown(self) -> None:
        """Stop every task still running (TERM, grace, KILL), echo the rest of their logs.

        Stopping comes first and nothing here raises for a record it cannot write (a full
        disk): the tasks must end whatever happened to the run dir.
        """
        from distlaunch.launcher.record import checkpoints

        self.console.show_live(None)
        self.book.best_effort = True
        if self.standbys is not None:
            self.standbys.close()
            self._record_standbys()
        alive = [t for t in self.tasks.values() if t.alive]
        if alive:
            self.book.set_state(RunState.STOPPING)
            _mark_stop_now(self.run_dir, self.attempt)
            self._stop(alive, TaskState.STOPPED, "the run is ending")
        for task in self.tasks.values():
            if task.follower is not None:
                task.follower.close()
            if task.handle is not None:
                task.handle.close()
        self.book.save()
        # Every task is gone: what a save cut short left is nobody's any more.
        removed = checkpoints.remove_cut_saves(contract.checkpoint_dir(self.run_dir))
        if removed:
            self.console.say(f"removed what saves cut short left: {', '.join(removed)}")

    # ---- records ----------------------------------------------------------------------------

    def _failure(
        self,
        task: _Task,
        how: str,
        note: str,
        where: tuple[str, ...],
        kind: EventKind,
        exit_code: int | None,
    ) -> Failure:
        from distlaunch.launcher.diagnosis.summary import Failure

        attempt = task.ledger.entry.attempt
        return Failure(
            task=task.name,
            how=how,
            log_file=task.plan.log_file,
            error_file=str(
                contract.error_path(self.run_dir, attempt, task.plan.role, task.plan.index)
            ),
            elapsed_s=time.monotonic() - self.run_started,
            note=note,
            stacks=where,
            stacks_dir=self.stacks_dir if where else "",
            kind=kind,
            exit_code=exit_code,
        )

    def _evidence(self, plan: TaskPlan) -> evidence.Evidence | None:
        from distlaunch.launcher.diagnosis.summary import Failure, evidence_of

        error_file = contract.error_path(self.run_dir, plan.attempt, plan.role, plan.index)
        return evidence_of(Failure(plan.name, "", plan.log_file, str(error_file), 0.0))

    def _error_type(self, task: TaskPlan) -> str | None:
        error = rundir.read_json(Path(task.env[contract.ERROR_FILE]))
        return error.get("type") if isinstance(error, dict) else None


def _mark_stop_now(run_dir: Path, attempt: int) -> None:
    """Tell the attempt's tasks that the SIGTERM coming is no stop notice (see worker/preempt.py);
    best effort: a task that does not see it saves within the grace period, or is killed."""
    path = contract.stop_now_path(run_dir, attempt)
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        rundir.create_file(path)
    except OSError:
        pass


def _rules(restart: Restart) -> RestartRules:
    return RestartRules(
        policy=restart.policy,
        max_restarts=restart.max_restarts,
        window_s=restart.window_s,
        initial_backoff_s=restart.backoff.initial_s,
        max_backoff_s=restart.backoff.max_s,
        non_retryable_exit_codes=tuple(restart.non_retryable_exit_codes),
    )


def _is_private(run_dir: Path) -> bool:
    return rundir.file_mode(run_dir) & 0o066 == 0


_TICK_S = 1 / os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _cpu_and_rss(pid: int) -> tuple[float | None, int | None]:
    """A process's CPU seconds (its own and its reaped children's) and RSS bytes, from one read
    of /proc/PID/stat (psutil takes three reads: it is asked for every task at every check)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The fields after the command name (which may hold spaces), from field 3 (state).
            fields = f.read().rsplit(b")", 1)[1].split()
        # Fields 14-17: utime, stime, cutime, cstime; field 24: rss in pages.
        ticks = sum(int(fields[i]) for i in range(11, 15))
        return ticks * _TICK_S, int(fields[21]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None, None


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass
