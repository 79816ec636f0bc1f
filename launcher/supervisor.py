"""The supervisor: starts a plan's tasks, watches them in one event loop, and ends the run.

One thread, one `select` over: every task's pidfd (an exit is seen the moment it happens), a
self-pipe that signal handlers write to (Ctrl-C, SIGTERM and `distlaunch restart`'s SIGUSR1 are
handled between events, never in the middle of bookkeeping), and a short timeout that pumps the
tasks' logs to the terminal and checks deadlines, heartbeats and due restarts.

What an event means is not decided here: the RestartPolicy answers CONTINUE, DONE, RESTART or
FAIL, and the supervisor carries it out and logs the decision with its reason.
"""

from __future__ import annotations

import os
import selectors
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from distlaunch.launcher import rundir
from distlaunch.launcher.console import Console, LogFollower
from distlaunch.launcher.errors import Interrupted
from distlaunch.launcher.plan import Plan, TaskPlan, for_attempt
from distlaunch.launcher.policy import Action, Cluster, Decision, RestartPolicy, RestartRules, TaskEvent
from distlaunch.launcher.spec import Restart, Timeouts
from distlaunch.launcher.summary import Failure
from distlaunch.launcher.transports.base import TaskHandle, Transport, exit_description
from distlaunch.worker import contract

# How often logs are echoed and deadlines checked while nothing else happens.
PUMP_INTERVAL_S = 0.05
# How often joins and heartbeats are checked.
CHECK_INTERVAL_S = 0.25
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# `distlaunch restart` drops a request file in the run's control/ folder and sends this signal.
CONTROL_SIGNAL = signal.SIGUSR1


@dataclass(frozen=True)
class RunResult:
    """How a run ended."""

    state: str  # rundir.SUCCEEDED or rundir.FAILED
    failure: Failure | None


class Supervisor:
    """Runs a plan to its end: success, a failure the policy will not restart, a timeout or a signal."""

    def __init__(
        self,
        plan: Plan,
        record: dict,
        console: Console,
        timeouts: Timeouts,
        transport: Transport,
        restart: Restart | None = None,
    ) -> None:
        self.plan = plan
        self.run_dir = Path(plan.run_dir)
        self.record = record
        self.console = console
        self.timeouts = timeouts
        self.transport = transport
        roles: dict[str, list[str]] = {}
        for task in plan.tasks:
            roles.setdefault(task.role, []).append(task.name)
        self.policy = RestartPolicy(Cluster(plan.strategy, roles), _rules(restart or Restart()))
        self.attempt = plan.attempt
        self.tasks = {t.name: t for t in plan.tasks}
        self.numbers = {t.name: i for i, t in enumerate(plan.tasks)}
        self.width = max(len(t.name) for t in plan.tasks)
        self.handles: dict[str, TaskHandle] = {}
        self.followers: dict[str, LogFollower] = {}
        self.exited: dict[str, int] = {}
        self.joined: set[str] = set()
        self.started: dict[str, float] = {}
        self.restart_times: list[float] = []
        self.pending: list[tuple[float, tuple[str, ...]]] = []  # (due time, tasks) restarts
        self.drain_until: float | None = None
        self.run_started = 0.0
        self._signals: list[int] = []
        self._sel = selectors.DefaultSelector()

    # ---- the loop -------------------------------------------------------------------------

    def run(self) -> RunResult:
        """Start every task, supervise until the run ends, and always tear everything down."""
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sel.register(wake_r, selectors.EVENT_READ, None)
        watched = (*STOP_SIGNALS, CONTROL_SIGNAL)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in watched}
        previous_fd = signal.set_wakeup_fd(wake_w)
        try:
            self.run_started = time.monotonic()
            for task in self.plan.tasks:
                self._check_stop_signals()
                self._start(task)
            self._save()
            result = self._loop(wake_r)
        finally:
            self._teardown()
            signal.set_wakeup_fd(previous_fd)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._sel.close()
            os.close(wake_r)
            os.close(wake_w)
        return result

    def _on_signal(self, signum: int, _frame: object) -> None:
        # Only note it: the loop wakes up through the wakeup fd and acts between events.
        self._signals.append(signum)

    def _loop(self, wake_r: int) -> RunResult:
        next_check = 0.0
        while True:
            more = False
            for follower in self.followers.values():
                more |= follower.pump()
            self.console.out.flush()
            for key, _ in self._sel.select(0 if more else self._select_timeout()):
                if key.data is None:
                    _drain(wake_r)
                    continue
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
            if result is None and now >= next_check:
                next_check = now + CHECK_INTERVAL_S
                result = self._check_deadlines(now)
            if result is not None:
                return result

    def _select_timeout(self) -> float:
        timeout = PUMP_INTERVAL_S
        if self.pending:
            timeout = min(timeout, max(0.0, min(due for due, _ in self.pending) - time.monotonic()))
        return timeout

    def _check_stop_signals(self) -> None:
        stops = [s for s in self._signals if s in STOP_SIGNALS]
        if stops:
            raise Interrupted(stops[0])

    def _check_signals(self) -> RunResult | None:
        while self._signals:
            signum = self._signals.pop(0)
            if signum in STOP_SIGNALS:
                raise Interrupted(signum)
            result = self._on_control_requests()
            if result is not None:
                return result
        return None

    # ---- events ---------------------------------------------------------------------------

    def _on_exit(self, task: TaskPlan) -> RunResult | None:
        handle = self.handles[task.name]
        code = handle.exit_status()  # its exit fd is readable: it has exited, this reaps it
        assert code is not None, f"{task.name}: exit fd readable but no exit status"
        self.exited[task.name] = code
        self.followers[task.name].close()
        how = exit_description(code)
        self._task_record(task, state="succeeded" if code == 0 else "failed", exit_code=code, exit=how, ended_at=time.time())
        if self.drain_until is not None:
            # Training already succeeded; the evaluator has now finished too.
            self._event(task, "exited", exit=how, exit_code=code, decision="done", reason="the evaluator finished after training")
            return RunResult(rundir.SUCCEEDED, None)
        event = TaskEvent(task.name, task.role, code, self._error_type(task))
        return self._apply(task, self.policy.decide(event, self.exited, self.restart_times, time.monotonic()),
                           "exited", exit=how, exit_code=code)

    def _on_hang(self, task: TaskPlan, silent_s: float) -> RunResult | None:
        """A task stopped making progress: stop it, then treat it like a failed task."""
        self._kill([task.name])
        self.exited[task.name] = -signal.SIGKILL
        self._task_record(task, state="failed", exit=f"no heartbeat for {silent_s:.0f} s", ended_at=time.time())
        event = TaskEvent(task.name, task.role, None)
        return self._apply(task, self.policy.decide(event, self.exited, self.restart_times, time.monotonic()),
                           "hung", silent_s=round(silent_s, 1))

    def _on_control_requests(self) -> RunResult | None:
        control = self.run_dir / "control"
        for request in sorted(control.glob("restart-*")) if control.is_dir() else ():
            name = request.name.removeprefix("restart-")
            request.unlink(missing_ok=True)
            if name not in self.tasks:
                continue
            task = self.tasks[name]
            result = self._apply(task, self.policy.decide(TaskEvent(name, task.role, None, manual=True), self.exited, self.restart_times, time.monotonic()), "restart-requested")
            if result is not None:
                return result
        return None

    def _apply(self, task: TaskPlan, decision: Decision, event: str, **fields: object) -> RunResult | None:
        """Log the policy's decision about ``task`` and carry it out."""
        self._event(task, event, decision=decision.action.value, reason=decision.reason, **fields)
        self._save()
        if decision.action is Action.DONE:
            return self._done()
        if decision.action is Action.FAIL:
            how = fields.get("exit") or f"stopped making progress (no heartbeat for {fields.get('silent_s')} s)"
            note = "" if self.policy.rules.policy == "never" else decision.reason.split("; ", 1)[-1]
            return RunResult(rundir.FAILED, self._failure(task, str(how), note))
        if decision.action is Action.RESTART:
            self.console.say(decision.reason + (f" in {decision.delay_s:g} s" if decision.delay_s else ""))
            self._schedule_restart(decision, manual=event == "restart-requested")
        return None

    def _done(self) -> RunResult | None:
        """Training succeeded: stop the servers; give a running evaluator time to finish."""
        evaluators = [n for n, t in self.tasks.items() if t.role == "evaluator" and self._alive(n)]
        others = [n for n in self.tasks if self._alive(n) and n not in evaluators]
        self._stop(others, "stopped", "training is done")
        if evaluators and self.timeouts.evaluator_drain_s > 0:
            self.drain_until = time.monotonic() + self.timeouts.evaluator_drain_s
            self.pending.clear()
            return None
        return RunResult(rundir.SUCCEEDED, None)

    # ---- restarts ---------------------------------------------------------------------------

    def _schedule_restart(self, decision: Decision, manual: bool) -> None:
        names = decision.tasks
        # Survivors of a gang are killed at once: they hold no state that the checkpoint does
        # not, and an MWMS worker blocked in a collective would sit out SIGTERM's grace anyway.
        self._kill([n for n in names if self._alive(n)])
        if not manual:
            self.restart_times.append(time.monotonic())
        self.attempt += 1
        rundir.make_dirs(self.run_dir, self.attempt, private=_is_private(self.run_dir))
        self.record["attempt"] = self.attempt
        self.pending = [(due, rest) for due, rest in self.pending if not set(rest) & set(names)]
        self.pending.append((time.monotonic() + decision.delay_s, names))
        self._save()

    def _start_due_restarts(self, now: float) -> RunResult | None:
        due = [names for when, names in self.pending if when <= now]
        if not due:
            return None
        self.pending = [(when, names) for when, names in self.pending if when > now]
        # Same ports and TF_CONFIG; a new DISTLAUNCH_ATTEMPT, log file and error file.
        plan = for_attempt(self.plan, self.attempt)
        for names in due:
            for name in names:
                self._check_stop_signals()
                restarts = int(self.record["tasks"][name].get("restarts", 0)) + 1
                self._start(plan.task(name), restarts=restarts)
        self._save()
        return None

    def _start(self, task: TaskPlan, restarts: int = 0) -> None:
        old = self.followers.get(task.name)
        if old is not None:
            old.close()
        previous = self.handles.get(task.name)
        if previous is not None:
            # The previous incarnation is stopped and reaped: release its pidfd (and an SSH
            # client's stdin pipe) before its successor takes its place.
            previous.close()
        handle = self.transport.start(task)
        self.handles[task.name] = handle
        self.tasks[task.name] = task
        self.exited.pop(task.name, None)
        self.joined.discard(task.name)
        self.started[task.name] = time.monotonic()
        prefix = self.console.prefix(task.name, self.numbers[task.name], self.width)
        self.followers[task.name] = LogFollower(task.log_file, prefix, self.console)
        self._sel.register(handle.exit_fd, selectors.EVENT_READ, task)
        self._task_record(task, state="starting", pid=handle.pid, pgid=handle.pid, started_at=time.time(),
                          restarts=restarts, exit_code=None, exit=None, ended_at=None)
        self._event(task, "restarted" if restarts else "started", pid=handle.pid)

    # ---- periodic checks ------------------------------------------------------------------

    def _check_deadlines(self, now: float) -> RunResult | None:
        if self.drain_until is not None:
            if now >= self.drain_until:
                for name in [n for n in self.tasks if self._alive(n)]:
                    self._stop([name], "stopped", f"the evaluator did not finish within {self.timeouts.evaluator_drain_s:g} s (timeouts.evaluator_drain_s)")
                return RunResult(rundir.SUCCEEDED, None)
            return None
        wall = time.time()
        for name, handle in list(self.handles.items()):
            task = self.tasks[name]
            if not self._alive(name) or task.role == "evaluator":
                continue
            if name not in self.joined:
                if handle.joined():
                    self.joined.add(name)
                    self._task_record(task, state="running", joined_after_s=round(now - self.started[name], 3))
                    self._event(task, "joined", port=task.port)
                    self._save()
                elif now - self.started[name] > self.timeouts.startup_s:
                    return RunResult(rundir.FAILED, self._failure(
                        task, f"did not start its TensorFlow server on port {task.port} within "
                        f"{self.timeouts.startup_s:g} s (timeouts.startup_s)"))
            if self.timeouts.heartbeat_s is not None:
                silent = self._silent_for(task, handle, wall)
                if silent is not None and silent > self.timeouts.heartbeat_s:
                    return self._on_hang(task, silent)
        if self.timeouts.run_s is not None and now - self.run_started > self.timeouts.run_s:
            limit = f"the run hit its time limit of {self.timeouts.run_s:g} s (timeouts.run_s)"
            running = [t for n, t in self.tasks.items() if self._alive(n)]
            if running:
                return RunResult(rundir.FAILED, self._failure(running[0], f"was still running when {limit}"))
            # Every task is down, waiting for a restart that is due later.
            waiting = self.tasks[self.pending[0][1][0]]
            return RunResult(rundir.FAILED, self._failure(waiting, f"was waiting to restart when {limit}"))
        return None

    def _silent_for(self, task: TaskPlan, handle: TaskHandle, wall: float) -> float | None:
        """Seconds since this incarnation's last heartbeat; None before its first one."""
        status = rundir.read_json(contract.status_path(self.run_dir, task.role, task.index))
        if not isinstance(status, dict) or status.get("attempt") != self.record["tasks"][task.name]["attempt"]:
            return None
        beat = status.get("time")
        return wall - beat if isinstance(beat, (int, float)) else None

    # ---- stopping ---------------------------------------------------------------------------

    def _alive(self, name: str) -> bool:
        return name in self.handles and name not in self.exited

    def _kill(self, names: list[str]) -> None:
        """Kill tasks now, through their transport (for restarts: nothing of theirs is worth a grace)."""
        handles = [self.handles[n] for n in names]
        for handle in handles:
            self._unwatch(handle)
        self.transport.kill(handles)
        for name in names:
            code = self._status_after_stop(self.handles[name])
            self.exited[name] = code
            self.followers[name].close()
            self._task_record(self.tasks[name], state="killed", exit_code=code, exit=exit_description(code), ended_at=time.time())
            self._event(self.tasks[name], "killed", exit=exit_description(code), reason="restarting")

    def _stop(self, names: list[str], state: str, reason: str) -> None:
        """Stop tasks the polite way: SIGTERM, the grace period, SIGKILL."""
        handles = [self.handles[n] for n in names]
        for handle in handles:
            self._unwatch(handle)
        self.transport.stop(handles, self.timeouts.grace_s)
        for handle in handles:
            name = handle.task.name
            code = self._status_after_stop(handle)
            self.exited[name] = code
            self.followers[name].close()
            self._task_record(handle.task, state=state, exit_code=code, exit=exit_description(code), ended_at=time.time())
            self._event(handle.task, state, exit=exit_description(code), reason=reason)

    @staticmethod
    def _status_after_stop(handle: TaskHandle) -> int:
        code = handle.exit_status()
        assert code is not None, f"{handle.task.name}: still running after its transport stopped it"
        return code

    def _unwatch(self, handle: TaskHandle) -> None:
        try:
            self._sel.unregister(handle.exit_fd)
        except (KeyError, ValueError):
            pass

    def _teardown(self) -> None:
        """Stop every task still running (TERM, grace, KILL), echo the rest of their logs."""
        alive = [n for n in self.handles if self._alive(n)]
        if alive:
            self.record["state"] = rundir.STOPPING
            self._save()
            self._stop(alive, "stopped", "the run is ending")
        for follower in self.followers.values():
            follower.close()
        for handle in self.handles.values():
            handle.close()
        self._save()

    # ---- records ----------------------------------------------------------------------------

    def _failure(self, task: TaskPlan, how: str, note: str = "") -> Failure:
        attempt = self.record["tasks"][task.name]["attempt"]
        return Failure(
            task=task.name,
            how=how,
            log_file=task.log_file,
            error_file=str(contract.error_path(self.run_dir, attempt, task.role, task.index)),
            elapsed_s=time.monotonic() - self.run_started,
            note=note,
        )

    def _error_type(self, task: TaskPlan) -> str | None:
        error = rundir.read_json(Path(task.env[contract.ERROR_FILE]))
        return error.get("type") if isinstance(error, dict) else None

    def _event(self, task: TaskPlan, event: str, **fields: object) -> None:
        attempt = self.record.get("tasks", {}).get(task.name, {}).get("attempt", self.attempt)
        rundir.append_event(self.run_dir, task=task.name, event=event, attempt=attempt, **fields)

    def _task_record(self, task: TaskPlan, **fields: object) -> None:
        entry = self.record.setdefault("tasks", {}).setdefault(task.name, {"role": task.role, "index": task.index, "port": task.port})
        if fields.get("state") == "starting":
            entry["attempt"] = int(task.env.get(contract.ATTEMPT, self.attempt))
        entry.update(fields)

    def _save(self) -> None:
        rundir.write_json(self.run_dir / rundir.RUN_JSON, self.record)


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


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass
