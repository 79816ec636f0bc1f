"""The supervisor's decisions, driven by a scripted fake transport: no process is started.

A fake task is a pipe standing in for a pidfd: its fate (exit with a code at once, after a delay,
or run until stopped) is scripted per task and attempt, so every branch of the loop (exits, gang
restarts, deadlines, signals, the evaluator's drain, two exits in one select() batch) runs in
milliseconds against the real supervisor, policy, run dir and events.
"""

from __future__ import annotations

import errno
import io
import json
import os
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import events, write_spec
from distlaunch.launcher.core.console import Console
from distlaunch.launcher.core.errors import Interrupted, RecordError
from distlaunch.launcher.diagnosis import stacks
from distlaunch.launcher.plan.placement import on_hosts
from distlaunch.launcher.plan.plan import Plan, TaskPlan, make_plan
from distlaunch.launcher.record import rundir
from distlaunch.launcher.record.endings import EventKind
from distlaunch.launcher.record.state import RunRecord, RunState
from distlaunch.launcher.run import supervisor
from distlaunch.launcher.run.policy import Action, Decision, RestartPolicy, TaskEvent
from distlaunch.launcher.run.supervisor import RunResult, Supervisor
from distlaunch.launcher.spec.model import Restart, Timeouts, load_spec
from distlaunch.worker import contract

RUNS_FOREVER = None
KILLED = -signal.SIGKILL
TERMINATED = -signal.SIGTERM
ON_FAILURE = Restart(policy="on-failure", max_restarts=3, backoff={"initial_s": 0, "max_s": 0})


@dataclass
class Fate:
    """What a fake task incarnation does: exit ``code`` after ``after_s`` (None: never)."""

    code: int | None = RUNS_FOREVER
    after_s: float = 0.0
    joins: bool = True


class FakeHandle:
    """A TaskHandle whose exit fd is a pipe the fake writes to when the task "exits"."""

    warm = False

    def __init__(self, task: TaskPlan, pid: int) -> None:
        self.task = task
        self.pid = pid
        self.exit_fd, self._write = os.pipe2(os.O_CLOEXEC)
        self.status: int | None = None
        self.closed = False
        self.joins = True
        self._lock = threading.Lock()

    def exit(self, code: int) -> None:
        """The task exits with ``code`` (first exit wins, as for a real process)."""
        with self._lock:
            if self.status is None and not self.closed:
                self.status = code
                os.write(self._write, b"x")

    def exit_status(self) -> int | None:
        return self.status

    def joined(self) -> bool:
        return self.joins

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                os.close(self.exit_fd)
                os.close(self._write)
                self.closed = True


@dataclass
class FakeTransport:
    """Starts fake tasks whose fates come from ``script(name, attempt)``; records every call."""

    script: Callable[[str, int], Fate]
    on_start: Callable[[TaskPlan], None] | None = None
    started: list[FakeHandle] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    killed: list[str] = field(default_factory=list)

    def start(self, task: TaskPlan) -> FakeHandle:
        # A restart must have released the previous incarnation's handle (issue 14 item 16).
        for old in self.started:
            assert old.task.name != task.name or old.closed, f"{task.name}: old handle still open"
        rundir.create_file(task.log_file)
        handle = FakeHandle(task, 1000 + len(self.started))
        fate = self.script(task.name, int(task.env[contract.ATTEMPT]))
        handle.joins = fate.joins
        self.started.append(handle)
        if fate.code is not None:
            if fate.after_s:
                threading.Timer(fate.after_s, handle.exit, (fate.code,)).start()
            else:
                handle.exit(fate.code)
        if self.on_start is not None:
            self.on_start(task)
        return handle

    def stop(self, handles: Sequence[FakeHandle], grace_s: float) -> None:
        for handle in handles:
            self.stopped.append(handle.task.name)
            handle.exit(TERMINATED)

    def kill(self, handles: Sequence[FakeHandle]) -> None:
        for handle in handles:
            self.killed.append(handle.task.name)
            handle.exit(KILLED)

    def stacks(self, handle: FakeHandle, native: bool) -> stacks.Source:
        def source() -> str:
            raise stacks.StackError("a fake task has no program to read")

        return source


def make_plan_for(tmp: Path, **spec: object) -> Plan:
    """A real plan of a spec (2 MWMS workers unless ``spec`` says otherwise) with fixed ports."""
    (tmp / "task.py").touch()
    loaded = load_spec(write_spec(tmp, **spec))
    roles = loaded.spec.tasks.by_role()
    ports = {
        (role, i): 20000 + 10 * n + i
        for n, role in enumerate(roles)
        for i in range(len(roles[role]))
    }
    run_dir = tmp / "runs" / "r1"
    rundir.make_dirs(run_dir, 0)
    return make_plan(loaded, on_hosts(loaded).with_ports(ports), "r1", run_dir)


def supervise(
    plan: Plan,
    transport: FakeTransport,
    restart: Restart = ON_FAILURE,
    standbys: object = None,
    **timeouts: float,
) -> tuple[RunResult, dict]:
    """Run the real supervisor over the fake transport; return its result and run.json."""
    record = RunRecord(run_id=plan.run_id, attempt=plan.attempt)
    console = Console(io.BytesIO(), io.BytesIO(), color=False)
    loop = Supervisor(plan, record, console, Timeouts(**timeouts), transport, restart, standbys)
    result = loop.run()
    # Teardown released every handle, also the last incarnations'.
    assert all(h.closed for h in transport.started)
    return result, json.loads((Path(plan.run_dir) / rundir.RUN_JSON).read_text())


def fates(
    table: dict[tuple[str, int], Fate], default: Fate | None = None
) -> Callable[[str, int], Fate]:
    """A script: each (task, attempt) in ``table`` meets its fate, the others ``default``
    (by default they run until stopped)."""
    return lambda name, attempt: table.get((name, attempt), default or Fate())


def test_every_worker_exits_0_and_the_run_succeeds(tmp: Path) -> None:
    transport = FakeTransport(fates({}, Fate(0)))
    result, record = supervise(make_plan_for(tmp), transport)
    assert result.state is RunState.SUCCEEDED and result.failure is None
    assert {t["state"] for t in record["tasks"].values()} == {"succeeded"}
    assert not transport.killed and not transport.stopped


def test_a_failed_worker_restarts_the_gang_then_succeeds(tmp: Path) -> None:
    transport = FakeTransport(
        fates({("worker-1", 0): Fate(1), ("worker-0", 1): Fate(0), ("worker-1", 1): Fate(0)})
    )
    plan = make_plan_for(tmp)
    result, record = supervise(plan, transport)
    assert result.state is RunState.SUCCEEDED
    assert transport.killed == ["worker-0"]  # the survivor of the gang, killed at once
    assert record["attempt"] == 1 and {t["restarts"] for t in record["tasks"].values()} == {1}
    story = events(Path(plan.run_dir))
    restart = [e for e in story if e.get("decision") == "restart"]
    assert len(restart) == 1 and restart[0]["task"] == "worker-1"
    assert [e["task"] for e in story if e["event"] == "restarted"] == ["worker-0", "worker-1"]


def test_two_exits_in_one_select_batch_make_one_gang_restart(tmp: Path) -> None:
    # Issue 14 item 1: both pipes are readable before the loop's first select().
    transport = FakeTransport(fates({("worker-0", 0): Fate(1), ("worker-1", 0): Fate(1)}, Fate(0)))
    plan = make_plan_for(tmp)
    result, record = supervise(plan, transport)
    assert result.state is RunState.SUCCEEDED
    assert record["attempt"] == 1
    story = events(Path(plan.run_dir))
    assert sum(e.get("decision") == "restart" for e in story) == 1
    assert sum(e["event"] == "restarted" for e in story) == 2


def test_the_restart_budget_ends_the_run_with_the_failing_task_named(tmp: Path) -> None:
    transport = FakeTransport(fates({}, Fate(3)))
    budget = Restart(policy="on-failure", max_restarts=2, backoff={"initial_s": 0, "max_s": 0})
    result, record = supervise(make_plan_for(tmp), transport, budget)
    assert result.state is RunState.FAILED and "exit code 3" in result.failure.how
    assert "restart budget exhausted" in result.failure.note
    assert record["attempt"] == 2


def test_policy_never_fails_at_once_without_a_note(tmp: Path) -> None:
    transport = FakeTransport(fates({("worker-1", 0): Fate(5)}))
    result, _ = supervise(make_plan_for(tmp), transport, Restart())
    assert result.state is RunState.FAILED and result.failure.task == "worker-1"
    assert result.failure.how == "exit code 5" and result.failure.note == ""
    assert transport.stopped == ["worker-0"]


def test_a_task_that_never_joins_fails_at_the_startup_deadline(tmp: Path) -> None:
    transport = FakeTransport(fates({("worker-1", 0): Fate(joins=False)}))
    result, _ = supervise(make_plan_for(tmp), transport, startup_s=0.2)
    assert result.state is RunState.FAILED and result.failure.task == "worker-1"
    assert "did not start its TensorFlow server" in result.failure.how


def test_the_run_deadline_while_a_restart_is_pending_fails_cleanly(tmp: Path) -> None:
    # Issue 14 item 9: every task is down, waiting out a backoff, when run_s expires.
    transport = FakeTransport(fates({("worker-1", 0): Fate(1)}))
    slow = Restart(policy="on-failure", max_restarts=3, backoff={"initial_s": 60, "max_s": 60})
    result, record = supervise(make_plan_for(tmp), transport, slow, run_s=0.3)
    assert result.state is RunState.FAILED
    assert "waiting to restart" in result.failure.how and "timeouts.run_s" in result.failure.how
    assert len(transport.started) == 2  # the restart never started


def test_the_run_deadline_stops_running_tasks(tmp: Path) -> None:
    transport = FakeTransport(fates({}))
    result, _ = supervise(make_plan_for(tmp), transport, run_s=0.2)
    assert result.state is RunState.FAILED and "still running" in result.failure.how
    assert sorted(transport.stopped) == ["worker-0", "worker-1"]


def test_a_silent_task_counts_as_hung_and_is_restarted(tmp: Path) -> None:
    plan = make_plan_for(tmp)
    stale = {"attempt": 0, "time": 1.0}  # a heartbeat from long ago
    contract.status_path(Path(plan.run_dir), "worker", 1).write_text(json.dumps(stale))
    transport = FakeTransport(fates({("worker-0", 1): Fate(0), ("worker-1", 1): Fate(0)}))
    result, record = supervise(plan, transport, heartbeat_s=1)
    assert result.state is RunState.SUCCEEDED and record["attempt"] == 1
    assert any(e["event"] == "hung" and e["task"] == "worker-1" for e in events(Path(plan.run_dir)))


def test_sigterm_stops_every_task_and_raises_interrupted(tmp: Path) -> None:
    def term_after_last(task: TaskPlan) -> None:
        if task.name == "worker-1":
            os.kill(os.getpid(), signal.SIGTERM)

    transport = FakeTransport(fates({}), on_start=term_after_last)
    with pytest.raises(Interrupted) as caught:
        supervise(make_plan_for(tmp), transport)
    assert caught.value.exit_code == 128 + signal.SIGTERM
    assert sorted(transport.stopped) == ["worker-0", "worker-1"]
    assert all(h.closed for h in transport.started)


def test_a_restart_request_restarts_the_gang_without_using_the_budget(tmp: Path) -> None:
    plan = make_plan_for(tmp)
    control = Path(plan.run_dir) / "control"

    def request_once(task: TaskPlan) -> None:
        if task.name == "worker-1" and task.env[contract.ATTEMPT] == "0":
            control.mkdir()
            (control / "restart-worker-1").touch()
            os.kill(os.getpid(), signal.SIGUSR1)

    transport = FakeTransport(
        fates({("worker-0", 1): Fate(0), ("worker-1", 1): Fate(0)}), on_start=request_once
    )
    no_budget = Restart(policy="on-failure", max_restarts=0)
    result, record = supervise(plan, transport, no_budget)
    assert result.state is RunState.SUCCEEDED and record["attempt"] == 1
    assert sorted(transport.killed) == ["worker-0", "worker-1"]
    assert not list(control.iterdir())


def test_the_evaluator_may_finish_after_training(tmp: Path) -> None:
    plan = make_plan_for(tmp, tasks={"worker": {"count": 2}, "evaluator": {"count": 1}})
    transport = FakeTransport(fates({("evaluator-0", 0): Fate(0, after_s=0.3)}, Fate(0)))
    result, record = supervise(plan, transport, evaluator_drain_s=30)
    assert result.state is RunState.SUCCEEDED
    assert record["tasks"]["evaluator-0"]["state"] == "succeeded"
    assert not transport.stopped


def test_an_evaluator_past_its_drain_time_is_stopped(tmp: Path) -> None:
    plan = make_plan_for(tmp, tasks={"worker": {"count": 2}, "evaluator": {"count": 1}})
    transport = FakeTransport(fates({("evaluator-0", 0): Fate()}, Fate(0)))
    result, record = supervise(plan, transport, evaluator_drain_s=0.2)
    assert result.state is RunState.SUCCEEDED
    assert (
        transport.stopped == ["evaluator-0"]
        and record["tasks"]["evaluator-0"]["state"] == "stopped"
    )


def fill_the_disk_after_one_write(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """run.json is written once; every later write finds the disk full (ENOSPC). Returns the list
    of writes tried, as they happen."""
    writes: list[int] = []

    def full_disk_open(fd: int, *args: object, **kw: object) -> object:
        # run.json's temp file is opened by descriptor: the second one finds the disk full.
        writes.append(fd)
        f = open(fd, *args, **kw)  # noqa: SIM115 - returned to the caller's `with`
        if len(writes) > 1:
            f.close()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return f

    monkeypatch.setattr(rundir, "open", full_disk_open, raising=False)
    return writes


def test_a_full_disk_stops_every_task_first_and_leaves_no_temp_file(
    tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 14 item 3: run.json is written once (every task started), then the disk is full
    # (ENOSPC) when the turn with worker-1's exit is to be recorded.
    plan = make_plan_for(tmp)
    fill_the_disk_after_one_write(monkeypatch)
    transport = FakeTransport(fates({("worker-1", 0): Fate(1)}))
    with pytest.raises(RecordError, match="No space left on device"):
        supervise(plan, transport)
    # The failed write surfaces at the end of the loop turn that recorded worker-1's exit (and
    # acted on it): whatever runs then is stopped, and nothing is left running.
    assert "worker-0" in transport.stopped
    assert all(h.status is not None and h.closed for h in transport.started)
    assert not list(Path(plan.run_dir).glob(".*.tmp"))
    assert json.loads((Path(plan.run_dir) / rundir.RUN_JSON).read_text())["state"] == "running"


def test_a_stop_signal_on_a_full_disk_still_ends_as_interrupted(
    tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # run.json is written once (every task started), then the disk is full. SIGTERM and
    # worker-0's exit come in one loop turn: the exit is recorded and the signal raises
    # Interrupted, whose exit code (128+15, for the shell and the scheduler) must survive the
    # failed save at the end of that turn; every task is still stopped.
    writes = fill_the_disk_after_one_write(monkeypatch)

    def exit_and_term(task: TaskPlan) -> None:
        if task.name == "worker-1":
            transport.started[0].exit(0)
            os.kill(os.getpid(), signal.SIGTERM)

    transport = FakeTransport(fates({}), on_start=exit_and_term)
    with pytest.raises(Interrupted) as caught:
        supervise(make_plan_for(tmp), transport)
    assert caught.value.exit_code == 128 + signal.SIGTERM
    assert transport.stopped == ["worker-1"] and len(writes) > 1
    assert all(h.closed for h in transport.started)


@dataclass
class FakeStandbys:
    """A StandbyPool that records what the supervisor asks of it; ``on_prepare`` scripts events."""

    on_prepare: Callable[[int], None]
    prepared: list[list[tuple[str, str]]] = field(default_factory=list)
    closed: int = 0
    polls: int = 0

    def prepare(self, tasks: Sequence[TaskPlan]) -> None:
        self.prepared.append([(t.name, t.env[contract.ATTEMPT]) for t in tasks])
        self.on_prepare(int(tasks[0].env[contract.ATTEMPT]))

    def poll(self) -> None:
        self.polls += 1

    def record(self) -> dict:
        return {} if self.closed else {"worker-0": {"pid": 1, "attempt": 0, "ready": True}}

    def close(self) -> None:
        self.closed += 1


def test_standbys_are_made_for_the_next_attempt_once_settled_and_go_at_the_end(
    tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Standbys for attempt 1 once both workers joined; a restart makes them stale, so after it
    they are made for attempt 2; training done closes them. Each step is triggered by the last."""
    monkeypatch.setattr(supervisor, "STANDBY_DELAY_S", 0.0)
    transport = FakeTransport(fates({}))

    def on_prepare(attempt: int) -> None:
        live = [h for h in transport.started if h.status is None]
        if attempt == 1:  # the first standbys exist: now a worker fails
            next(h for h in live if h.task.name == "worker-1").exit(1)
        else:  # the second ones exist: the gang finishes
            for handle in live:
                handle.exit(0)

    pool = FakeStandbys(on_prepare)
    plan = make_plan_for(tmp)
    result, record = supervise(plan, transport, standbys=pool)
    assert result.state is RunState.SUCCEEDED
    assert pool.prepared == [
        [("worker-0", "1"), ("worker-1", "1")],
        [("worker-0", "2"), ("worker-1", "2")],
    ]
    assert pool.closed >= 1 and pool.polls > 0
    assert "standbys" not in record  # none left to list
    started = [h.task.env[contract.ATTEMPT] for h in transport.started]
    assert started == ["0", "0", "1", "1"]


# ---- every ending of a task or of the run is an event the policy decides ---------------------


@pytest.fixture
def decided(monkeypatch: pytest.MonkeyPatch) -> list[tuple[TaskEvent, Decision]]:
    """Every (event, decision) of RestartPolicy.decide during the test, in order."""
    seen: list[tuple[TaskEvent, Decision]] = []
    real = RestartPolicy.decide

    def spy(self: RestartPolicy, event: TaskEvent, *args: object) -> Decision:
        decision = real(self, event, *args)
        seen.append((event, decision))
        return decision

    monkeypatch.setattr(RestartPolicy, "decide", spy)
    return seen


def kinds(decided: list[tuple[TaskEvent, Decision]]) -> list[tuple[str, EventKind, Action]]:
    return [(e.name, e.kind, d.action) for e, d in decided]


def test_an_exit_is_decided_and_its_failure_is_typed(tmp: Path, decided: list) -> None:
    transport = FakeTransport(fates({("worker-1", 0): Fate(5)}))
    result, _ = supervise(make_plan_for(tmp), transport, Restart())
    assert kinds(decided) == [("worker-1", EventKind.EXITED, Action.FAIL)]
    assert result.failure.kind is EventKind.EXITED and result.failure.exit_code == 5


def test_a_hang_is_decided_as_hung(tmp: Path, decided: list) -> None:
    plan = make_plan_for(tmp)
    stale = {"attempt": 0, "time": 1.0}
    contract.status_path(Path(plan.run_dir), "worker", 1).write_text(json.dumps(stale))
    result, _ = supervise(plan, FakeTransport(fates({})), Restart(), heartbeat_s=1)
    assert kinds(decided) == [("worker-1", EventKind.HUNG, Action.FAIL)]
    assert result.failure.kind is EventKind.HUNG and result.failure.exit_code is None
    assert result.failure.how.startswith("no heartbeat for ")


def test_a_restart_request_is_decided_as_manual(tmp: Path, decided: list) -> None:
    plan = make_plan_for(tmp)
    control = Path(plan.run_dir) / "control"

    def request_once(task: TaskPlan) -> None:
        if task.name == "worker-1" and task.env[contract.ATTEMPT] == "0":
            control.mkdir()
            (control / "restart-worker-1").touch()
            os.kill(os.getpid(), signal.SIGUSR1)

    script = fates({("worker-0", 1): Fate(0), ("worker-1", 1): Fate(0)})
    result, _ = supervise(plan, FakeTransport(script, on_start=request_once), Restart())
    assert kinds(decided)[0] == ("worker-1", EventKind.MANUAL, Action.RESTART)
    assert result.state is RunState.SUCCEEDED


def test_the_startup_deadline_is_decided(tmp: Path, decided: list) -> None:
    transport = FakeTransport(fates({("worker-1", 0): Fate(joins=False)}))
    result, _ = supervise(make_plan_for(tmp), transport, startup_s=0.2)
    assert kinds(decided) == [("worker-1", EventKind.STARTUP_TIMEOUT, Action.FAIL)]
    assert result.failure.kind is EventKind.STARTUP_TIMEOUT and result.failure.note == ""


def test_a_cluster_that_never_formed_is_decided(tmp: Path, decided: list) -> None:
    def leader_waits_for_worker_1(task: TaskPlan) -> None:
        if task.name == "worker-0":  # the coordination service's leader logs who is missing
            Path(task.log_file).write_text(
                "Waiting for 1/2 tasks to connect.\nExample stragglers:\n"
                "/job:worker/replica:0/task:1\n"
            )

    transport = FakeTransport(fates({}), on_start=leader_waits_for_worker_1)
    result, _ = supervise(make_plan_for(tmp), transport, formation_s=0.1)
    assert kinds(decided) == [("worker-1", EventKind.FORMATION, Action.FAIL)]
    assert result.failure.task == "worker-1" and result.failure.kind is EventKind.FORMATION
    assert result.failure.how.startswith("never connected to the coordination service")


def test_both_run_deadlines_are_decided(tmp: Path, decided: list) -> None:
    result, _ = supervise(make_plan_for(tmp), FakeTransport(fates({})), run_s=0.2)
    assert kinds(decided) == [("worker-0", EventKind.RUN_TIMEOUT, Action.FAIL)]
    assert result.failure.kind is EventKind.RUN_TIMEOUT
    decided.clear()
    slow = Restart(policy="on-failure", max_restarts=3, backoff={"initial_s": 60, "max_s": 60})
    transport = FakeTransport(fates({("worker-1", 0): Fate(1)}))
    (tmp / "waiting").mkdir()
    result, _ = supervise(make_plan_for(tmp / "waiting"), transport, slow, run_s=0.3)
    assert kinds(decided) == [
        ("worker-1", EventKind.EXITED, Action.RESTART),
        ("worker-0", EventKind.RUN_TIMEOUT, Action.FAIL),
    ]
    assert "waiting to restart" in result.failure.how


@pytest.mark.parametrize("evaluator", [Fate(0, after_s=0.3), Fate()], ids=["finished", "late"])
def test_the_end_of_the_evaluators_drain_is_decided(
    tmp: Path, decided: list, evaluator: Fate
) -> None:
    plan = make_plan_for(tmp, tasks={"worker": {"count": 2}, "evaluator": {"count": 1}})
    transport = FakeTransport(fates({("evaluator-0", 0): evaluator}, Fate(0)))
    result, _ = supervise(plan, transport, evaluator_drain_s=0.6)
    assert kinds(decided)[-1] == ("evaluator-0", EventKind.DRAINED, Action.DONE)
    assert result.state is RunState.SUCCEEDED and result.failure is None


def test_a_peer_named_lost_but_still_running_is_the_cause_and_counts_as_hung(
    tmp: Path, decided: list
) -> None:
    # worker-0 dies of a follow-on error naming worker-1, which still runs (frozen): the root
    # cause is worker-1, typed hung, not worker-0's exit.
    def worker_0_loses_worker_1(task: TaskPlan) -> None:
        if task.name == "worker-0":
            error = {
                "type": "UnavailableError",
                "message": "Task unhealthy: /job:worker/replica:0/task:1",
            }
            Path(task.env[contract.ERROR_FILE]).write_text(json.dumps(error))

    script = fates({("worker-0", 0): Fate(1, after_s=0.2)})
    transport = FakeTransport(script, on_start=worker_0_loses_worker_1)
    result, _ = supervise(make_plan_for(tmp), transport, Restart())
    assert kinds(decided) == [("worker-0", EventKind.EXITED, Action.FAIL)]
    assert result.failure.task == "worker-1" and result.failure.kind is EventKind.HUNG
    assert result.failure.how.startswith("stopped answering its peers")
    assert result.failure.exit_code is None
