"""The supervisor: starts a plan's tasks, watches them in one event loop, and ends the run.

One thread, one `select` over: every task's pidfd (an exit is seen the moment it happens), a
self-pipe that signal handlers write to (Ctrl-C and SIGTERM are handled between events, never in
the middle of bookkeeping), and a short timeout that pumps the tasks' logs to the terminal and
checks the startup and run deadlines.
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
from distlaunch.launcher.local import LocalHandle, LocalTransport
from distlaunch.launcher.plan import Plan, TaskPlan
from distlaunch.launcher.policy import Action, ExitEvent, ExitPolicy
from distlaunch.launcher.procs import exit_description
from distlaunch.launcher.spec import Timeouts
from distlaunch.launcher.summary import Failure
from distlaunch.worker import contract

# How often logs are echoed and deadlines checked while nothing else happens.
PUMP_INTERVAL_S = 0.05
# How often a task that has not joined yet is checked for a listening server.
JOIN_CHECK_S = 0.25
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class RunResult:
    """How a run ended."""

    state: str  # rundir.SUCCEEDED or rundir.FAILED
    failure: Failure | None


class Supervisor:
    """Runs one attempt of a plan to its end: success, a task's failure, a timeout or a signal."""

    def __init__(self, plan: Plan, record: dict, console: Console, timeouts: Timeouts, transport: LocalTransport | None = None) -> None:
        self.plan = plan
        self.run_dir = Path(plan.run_dir)
        self.record = record
        self.console = console
        self.timeouts = timeouts
        self.transport = transport or LocalTransport()
        self.policy = ExitPolicy(plan.strategy)
        self.training = {t.name for t in plan.tasks if t.role != "evaluator"}
        self.handles: dict[str, LocalHandle] = {}
        self.followers: dict[str, LogFollower] = {}
        self.exited: dict[str, int] = {}
        self.joined: set[str] = set()
        self.started_at = 0.0
        self._signal: int | None = None

    def run(self) -> RunResult:
        """Start every task, supervise until the run ends, and always tear everything down."""
        sel = selectors.DefaultSelector()
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        sel.register(wake_r, selectors.EVENT_READ, None)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        previous_fd = signal.set_wakeup_fd(wake_w)
        try:
            self._start_all(sel)
            result = self._loop(sel, wake_r)
        finally:
            self._teardown()
            signal.set_wakeup_fd(previous_fd)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            sel.close()
            os.close(wake_r)
            os.close(wake_w)
        return result

    def _on_signal(self, signum: int, _frame: object) -> None:
        # Only note it: the loop wakes up through the wakeup fd and acts between events.
        if self._signal is None:
            self._signal = signum

    def _start_all(self, sel: selectors.BaseSelector) -> None:
        width = max(len(t.name) for t in self.plan.tasks)
        self.started_at = time.monotonic()
        for number, task in enumerate(self.plan.tasks):
            if self._signal is not None:
                raise Interrupted(self._signal)
            handle = self.transport.start(task)
            self.handles[task.name] = handle
            self.followers[task.name] = LogFollower(task.log_file, self.console.prefix(task.name, number, width), self.console)
            sel.register(handle.exit_fd, selectors.EVENT_READ, task)
            self._task_record(task, state="starting", pid=handle.pid, pgid=handle.pid, started_at=time.time())
            rundir.append_event(self.run_dir, task=task.name, event="started", pid=handle.pid, attempt=self.plan.attempt)
        self._save()

    def _loop(self, sel: selectors.BaseSelector, wake_r: int) -> RunResult:
        next_join_check = 0.0
        while True:
            more = False
            for follower in self.followers.values():
                more |= follower.pump()
            self.console.out.flush()
            for key, _ in sel.select(0 if more else PUMP_INTERVAL_S):
                if key.data is None:
                    _drain(wake_r)
                    continue
                sel.unregister(key.fd)
                result = self._on_exit(key.data)
                if result is not None:
                    return result
            if self._signal is not None:
                raise Interrupted(self._signal)
            now = time.monotonic()
            if now >= next_join_check:
                next_join_check = now + JOIN_CHECK_S
                result = self._check_deadlines(now)
                if result is not None:
                    return result

    def _on_exit(self, task: TaskPlan) -> RunResult | None:
        handle = self.handles[task.name]
        code = handle.returncode()
        if code is None:  # pidfd readable means exited; poll() reaps it
            code = handle.proc.wait()
        self.exited[task.name] = code
        self.followers[task.name].close()
        how = exit_description(code)
        decision = self.policy.decide(ExitEvent(task.name, task.role, code), self.exited, self.training)
        self._task_record(task, state="succeeded" if code == 0 else "failed", exit_code=code, exit=how, ended_at=time.time())
        rundir.append_event(
            self.run_dir, task=task.name, event="exited", exit=how, exit_code=code,
            decision=decision.action.value, reason=decision.reason, attempt=self.plan.attempt,
        )
        self._save()
        if decision.action is Action.DONE:
            return RunResult(rundir.SUCCEEDED, None)
        if decision.action is Action.FAIL:
            return RunResult(rundir.FAILED, self._failure(task, how))
        return None

    def _check_deadlines(self, now: float) -> RunResult | None:
        elapsed = now - self.started_at
        for name, handle in self.handles.items():
            task = handle.task
            if name in self.joined or name in self.exited or task.role == "evaluator":
                continue
            if handle.joined():
                self.joined.add(name)
                self._task_record(task, state="running", joined_after_s=round(elapsed, 3))
                rundir.append_event(self.run_dir, task=name, event="joined", port=task.port, attempt=self.plan.attempt)
                self._save()
            elif elapsed > self.timeouts.startup_s:
                return RunResult(rundir.FAILED, self._failure(
                    task, f"did not start its TensorFlow server on port {task.port} within "
                    f"{self.timeouts.startup_s:g} s (timeouts.startup_s)"))
        if self.timeouts.run_s is not None and elapsed > self.timeouts.run_s:
            running = next(t for t in self.plan.tasks if t.name not in self.exited)
            return RunResult(rundir.FAILED, self._failure(
                running, f"was still running when the run hit its time limit of {self.timeouts.run_s:g} s (timeouts.run_s)"))
        return None

    def _failure(self, task: TaskPlan, how: str) -> Failure:
        return Failure(
            task=task.name,
            how=how,
            log_file=task.log_file,
            error_file=str(contract.error_path(self.run_dir, self.plan.attempt, task.role, task.index)),
            elapsed_s=time.monotonic() - self.started_at,
        )

    def _teardown(self) -> None:
        """Stop every task still running (TERM, grace, KILL), echo the rest of their logs."""
        alive = [h for name, h in self.handles.items() if name not in self.exited]
        if alive:
            self.record["state"] = rundir.STOPPING
            self._save()
            self.transport.stop(alive, self.timeouts.grace_s)
            for handle in alive:
                code = handle.proc.returncode
                self._task_record(handle.task, state="stopped", exit_code=code, exit=exit_description(code), ended_at=time.time())
                rundir.append_event(self.run_dir, task=handle.task.name, event="stopped", exit=exit_description(code), attempt=self.plan.attempt)
        for follower in self.followers.values():
            follower.close()
        for handle in self.handles.values():
            handle.close()
        self._save()

    def _task_record(self, task: TaskPlan, **fields: object) -> None:
        entry = self.record.setdefault("tasks", {}).setdefault(task.name, {"role": task.role, "index": task.index, "port": task.port})
        entry["attempt"] = self.plan.attempt
        entry.update(fields)

    def _save(self) -> None:
        rundir.write_json(self.run_dir / rundir.RUN_JSON, self.record)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass
