"""The supervisor: starts a plan's tasks, watches them in one event loop, and ends the run.

One thread, one `select` over: every task's exit fd (a pidfd: an exit is seen the moment it
happens), a self-pipe that signal handlers write to (Ctrl-C, SIGTERM and `distlaunch restart`'s
SIGUSR1 are handled between events, never in the middle of bookkeeping), and a short timeout that
pumps the tasks' logs to the terminal and checks deadlines, heartbeats and due restarts.

The loop says when; what an event means is not decided here: every ending of a task or of the
run (an exit, a hang, a restart request, a deadline, a cluster that never formed, the evaluator's
drain, a stop notice and its save) becomes a `TaskEvent` that the RestartPolicy answers with a
`Decision`, which `events.Events` records and carries out. The run is in one `events.Phase` at a
time (training, saving on a stop notice, draining the evaluator, deciding an elastic run's world),
which says what an exit means and which deadlines the loop checks. Each concern is a collaborator of its own:

- `crew.Crew`: the tasks, their incarnations and processes (through `transports.base` only);
- `journal.Journal`: every write of run.json and events.jsonl (a task's ledger, the run's record);
- `restarts.Restarts`: the attempts, the restarts waiting out their backoff, the policy's history;
- `deadlines.Deadlines`: joins, startup, heartbeat, silence, formation, run time, the drain;
- `notice.StopNotices`: a stop notice under way (SIGTERM or SIGUSR2 to the launcher: `distlaunch
  down`, Slurm's `--signal`, a container stop), its held notices, its save's deadline;
- `events.Events`: each event decided by the policy and carried out;
- `exits.Exits`: what an exit means as data (OOM kills, follow-on errors) and the failure to report;
- `warm.WarmStandbys`: the warm standbys of the next attempt;
- `elastic.World` and `resizing.Resizing`: an elastic run's world (the plan's `elastic`): which
  worker slots train, the places probed, lost or held out, and the resizes carried out.

An elastic run's course (docs/elastic.md): a worker whose host's agent is lost (or whom its
peers' TensorFlow names lost while it still seems to run) stops the gang at once, and the run is
RESIZING while the host is probed; a host that answers restarts the same world (a restart), one
that does not is lost and, after the settle window, the gang restarts in a smaller world from the
latest checkpoint. Restarts exhausted hold the failing place out and do the same. A host back
while the world trains grows it: a save at an agreed step through the notice path (SAVING, the
notice's ``resize`` set: the run does not end), then the restart in the bigger world.

A notice's course: the first is sent to every training task's program and the policy hears each
exit as a PREEMPTED event; when all have saved (or finished), the run ends PREEMPTED, else, at
the first task that exits unsaved, it is stopped as a signal stops it (Interrupted). At
timeouts.save_s the tasks still saving get timeouts.grace_s more (SIGTERM, then SIGKILL): a save
that ends then still counts, reported late. A second notice joins the save under way; a third,
Ctrl-C, or a notice the run cannot keep stops at once. A notice after training was done ends
the run succeeded (an evaluator still draining is cut). When the run ends, the ``ckpt-N_temp/``
folders of saves cut short are removed.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from distlaunch.launcher.core.console import Console
from distlaunch.launcher.core.errors import Interrupted
from distlaunch.launcher.plan.plan import Plan, TaskPlan
from distlaunch.launcher.record import rundir
from distlaunch.launcher.record.state import RunBook, RunRecord, RunState
from distlaunch.launcher.run.crew import Crew
from distlaunch.launcher.run.deadlines import Deadlines
from distlaunch.launcher.run.elastic import World
from distlaunch.launcher.run.events import Events, Phase, RunResult
from distlaunch.launcher.run.journal import Journal
from distlaunch.launcher.run.notice import NOTICE_SIGNALS, Preemption, StopNotices, mark_stop_now
from distlaunch.launcher.run.policy import Cluster, RestartPolicy, RestartRules
from distlaunch.launcher.run.resizing import Resizing
from distlaunch.launcher.run.restarts import Restarts
from distlaunch.launcher.run.warm import STANDBY_DELAY_S, WarmStandbys
from distlaunch.launcher.spec.model import Restart, Timeouts
from distlaunch.launcher.transports.base import StandbyPool, Transport
from distlaunch.worker import contract

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
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, rundir.PRE_TIMEOUT_SIGNAL)

__all__ = ["Phase", "Preemption", "RunResult", "Supervisor"]


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
        # An elastic run's plan holds every slot: the world that runs is a choice of them.
        self.world = World(plan, transport, console.say) if plan.elastic is not None else None
        if self.world is not None:
            plan = self.world.plan()
        self.plan = plan
        self.run_dir = Path(plan.run_dir)
        self.book = RunBook(self.run_dir, record, console.say)
        self.console = console
        self.timeouts = timeouts
        self.transport = transport
        roles: dict[str, list[str]] = {}
        for task in plan.tasks:
            roles.setdefault(task.role, []).append(task.name)
        self.policy = RestartPolicy(Cluster(plan.strategy, roles), _rules(restart or Restart()))
        self.journal = Journal(self.book)
        self.crew = Crew(plan, self.book, console, transport, self.journal)
        self.restarts = Restarts(plan, self.crew, self.journal)
        self.deadlines = Deadlines(self.crew, self.journal, timeouts)
        # What set timeouts.save_s, for the notice's lines: a bound of the notice's source
        # (``save_why``), else the spec.
        save_why = save_why or "timeouts.save_s"
        savers = self.policy.cluster.savers()
        self.notices = StopNotices(
            self.crew, self.journal, console, savers, timeouts.save_s, save_why
        )
        self.standbys = WarmStandbys(standbys, plan, self.journal)
        resizing = None
        if self.world is not None:
            resizing = Resizing(
                self.world, console, transport, self.policy, self.crew, self.journal,
                self.restarts, self.notices, self.standbys,
            )  # fmt: skip
        self.events = Events(
            plan, console, timeouts, transport, self.policy, self.crew, self.journal,
            self.restarts, self.deadlines, self.notices, self.standbys, resizing,
        )  # fmt: skip
        self._signals: list[int] = []
        self._next_check = self._next_live = 0.0  # when the loop checks deadlines, redraws

    @property
    def record(self) -> RunRecord:
        """The run's record, as run.json has it."""
        return self.book.record

    @property
    def attempt(self) -> int:
        """The run's current attempt."""
        return self.restarts.attempt

    # ---- the loop -------------------------------------------------------------------------

    def run(self) -> RunResult:
        """Start every task, supervise until the run ends, and always tear everything down."""
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.crew.watch_wakeup(wake_r)
        watched = (*STOP_SIGNALS, rundir.CONTROL_SIGNAL)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in watched}
        previous_fd = signal.set_wakeup_fd(wake_w)
        try:
            self.deadlines.run_started = time.monotonic()
            with self.journal.batch():
                for task in self.plan.tasks:
                    self._check_stop_signals()
                    self._start(task)
            result = self._loop()
        finally:
            self._teardown()
            signal.set_wakeup_fd(previous_fd)
            for sig, handler in previous.items():
                if self.notices.current is not None and sig in NOTICE_SIGNALS:
                    # A notice that comes now (a second `down` as the run ends) has nothing
                    # left to save: it must not turn the launcher's exit code (75) into a death
                    # by SIGTERM. The supervisor runs in a launcher process (the CLI's, the
                    # API's child), which exits once the run's end is recorded.
                    handler = signal.SIG_IGN
                signal.signal(sig, handler)
            os.close(wake_r)
            os.close(wake_w)
        return result

    def _loop(self) -> RunResult:
        """The run, turn by turn until it ends (torch elastic's `_invoke_run`, as one select).

        Each turn echoes the logs, waits for an exit or a signal (at most until the next due
        restart, or PUMP_INTERVAL_S), then handles what came, in this order: the exits seen
        (decided as the run's phase says), the signals taken (stop notices, restart requests),
        the restarts due and, every CHECK_INTERVAL_S, the phase's deadlines, after which the
        warm standbys are tended. The first handler that ends the run returns its result.
        """
        while True:
            more = self.crew.pump()
            timeout = 0.0 if more else self._timeout()
            # Exits seen together: a task's own failure is handled before its peers' follow-on
            # errors, so that the root cause is the task that died, not a survivor.
            ready = self.crew.ready(timeout, order=self.events.exits.follow_on)
            # One save of run.json for all that this turn changed: a save per event would write
            # the whole record once per task (256 tasks joining: 256 saves of all 256 entries).
            with self.journal.batch():
                result = None
                for task in ready:
                    # False: an earlier exit of this batch dealt with it (a gang restart).
                    if result is None and self.crew.claim(task):
                        result = self.events.on_exit(task)
                result = result or self._on_signals()
                if result is None:
                    for plan in self.restarts.due(time.monotonic()):
                        self._check_stop_signals()
                        restarts = self.crew[plan.name].ledger.entry.restarts + 1
                        self._start(plan, restarts=restarts)
                now = time.monotonic()
                if result is None and now >= self._next_check:
                    self._next_check = now + CHECK_INTERVAL_S
                    result = self._check(now)
                    if result is None:
                        pending = bool(self.restarts.pending)
                        settled = self.deadlines.settled(now, STANDBY_DELAY_S, pending)
                        self.standbys.tend(settled, self.attempt)
            if result is not None:
                return result
            self._draw_live(now)

    def _timeout(self) -> float:
        due = self.restarts.next_due()
        if due is None:
            return PUMP_INTERVAL_S
        return min(PUMP_INTERVAL_S, max(0.0, due - time.monotonic()))

    def _draw_live(self, now: float) -> None:
        """Redraw a terminal's live progress line, every LIVE_INTERVAL_S."""
        if not self.console.live or now < self._next_live:
            return
        from distlaunch.launcher.diagnosis.progress_view import live_line, task_progress

        self._next_live = now + LIVE_INTERVAL_S
        self.console.show_live(live_line(task_progress(self.run_dir, self.record)))

    def _start(self, plan: TaskPlan, restarts: int = 0) -> None:
        """Start ``plan``'s task (again, after ``restarts`` restarts)."""
        task = self.crew.start(plan, restarts)
        self.restarts.peer_lost.discard(plan.name)
        self.deadlines.started(task)

    def _check(self, now: float) -> RunResult | None:
        """The periodic checks of the run's phase, each of which may end a task or the run
        (through the policy)."""
        phase = self.events.phase
        if phase is Phase.DRAINING:
            if not self.deadlines.drain_due(now):
                return None
            lapse = self.deadlines.drained()
            if lapse is None:  # nothing runs any more: nothing to drain
                return RunResult(RunState.SUCCEEDED, None)
            return self.events.on_lapse(lapse)
        if phase is Phase.RESIZING:
            return self.events.on_membership(now)
        if phase is Phase.SAVING:
            # Saving tasks make no progress, nor is a deadline other than the save's theirs now.
            self.notices.release_held()
            unsaved = self.notices.overdue(now)
            return self.events.on_save_due(unsaved) if unsaved else None
        lapse = self.deadlines.check(now, self.restarts.waiting())
        if lapse is not None:
            return self.events.on_lapse(lapse)
        return self.events.on_membership(now) if self.world is not None else None

    # ---- signals ----------------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: object) -> None:
        # Only note it: the loop wakes up through the wakeup fd and acts between events.
        self._signals.append(signum)

    def _check_stop_signals(self) -> None:
        """While tasks start: a stop signal stops at once; a notice waits for the loop (it is
        held for the tasks that cannot take it yet)."""
        stops = [s for s in self._signals if s in STOP_SIGNALS and s not in NOTICE_SIGNALS]
        if stops:
            raise Interrupted(stops[0])

    def _on_signals(self) -> RunResult | None:
        while self._signals:
            signum = self._signals.pop(0)
            if signum in NOTICE_SIGNALS:
                result = self.events.on_notice(signum)
            elif signum in STOP_SIGNALS:
                raise Interrupted(signum)
            else:
                result = self.events.on_requests()
            if result is not None:
                return result
        return None

    def _teardown(self) -> None:
        """Stop every task still running (TERM, grace, KILL), echo the rest of their logs.

        Stopping comes first and nothing here raises for a record it cannot write (a full
        disk): the tasks must end whatever happened to the run dir.
        """
        from distlaunch.launcher.record import checkpoints

        self.console.show_live(None)
        self.book.best_effort = True
        self.standbys.close()
        if self.world is not None:
            self.world.close()
        alive = self.crew.alive()
        if alive:
            self.journal.set_state(RunState.STOPPING)
            mark_stop_now(self.run_dir, self.attempt)
            self.events.stop(alive, "the run is ending")
        self.crew.close()
        self.journal.save()
        # Every task is gone: what a save cut short left is nobody's any more.
        removed = checkpoints.remove_cut_saves(contract.checkpoint_dir(self.run_dir))
        if removed:
            self.console.say(f"removed what saves cut short left: {', '.join(removed)}")


def _rules(restart: Restart) -> RestartRules:
    return RestartRules(
        policy=restart.policy,
        max_restarts=restart.max_restarts,
        window_s=restart.window_s,
        initial_backoff_s=restart.backoff.initial_s,
        max_backoff_s=restart.backoff.max_s,
        non_retryable_exit_codes=tuple(restart.non_retryable_exit_codes),
    )
