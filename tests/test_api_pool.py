"""The warm pool of `distlaunch.run`: later calls of one process reuse the tasks of an earlier
call (real TensorFlow processes, a strategy made again in each call), and any failure behaves
as it does without the pool. What the pool does with any interpreter (its close, its off switch,
a failed or killed task, a killed caller) is shown on calls that import no TensorFlow: each
TensorFlow start costs seconds and would show nothing more there.

A task runs in its own PID namespace (os.getpid() is the same small number in every task), so
an interpreter is told apart by a token it draws once and keeps in a module of its own (not in
its environment: each pooled call sees the caller's environment of that call).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

import distlaunch
from conftest import processes_of_run, wait_for
from distlaunch.launcher.api import pool as api_pool
from distlaunch.launcher.api.call import start
from test_api import assert_nothing_left

pytestmark = pytest.mark.integration


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory of its own, the pool on (whatever the environment says); on the way
    out the pool is closed and every run made under it must have left nothing running."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(api_pool.POOL_ENV, raising=False)
    before = set(psutil.Process().children(recursive=True))
    yield tmp_path
    api_pool.close()
    for run_json in tmp_path.glob("runs/*/run.json"):
        assert_nothing_left(run_json.parent)
    launchers = [p for p in psutil.Process().children(recursive=True) if p not in before]
    assert not [p for p in launchers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def interpreter(label: str) -> dict[str, str]:
    """Runs on a task: which interpreter this is (a token drawn at its first call), its run, and
    an all-reduce through a strategy made again in this call."""
    import uuid

    import tensorflow as tf

    token = os.__dict__.setdefault("pool_test_token", uuid.uuid4().hex)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = strategy.cluster_resolver.task_id
    print(f"{label} on task {task}", flush=True)
    total = strategy.reduce("SUM", strategy.run(lambda: tf.constant(task + 1.0)), axis=None)
    assert float(total) == 3.0
    return {"token": token, "run": os.environ["DISTLAUNCH_RUN_ID"]}


def interpreter_only(label: str) -> dict[str, str]:
    """`interpreter` without TensorFlow, for what the pool does with any interpreter (close,
    off switch, failures, a killed caller): which interpreter this is, and its run."""
    import uuid

    token = os.__dict__.setdefault("pool_test_token", uuid.uuid4().hex)
    print(f"{label} in {token}", flush=True)
    return {"token": token, "run": os.environ["DISTLAUNCH_RUN_ID"]}


def tokens(values: dict[str, dict[str, str]]) -> dict[str, str]:
    return {task: v["token"] for task, v in values.items()}


def test_close_pool_ends_the_warm_cluster_and_the_next_call_starts_anew(here):
    first = distlaunch.run(interpreter_only, "first", quiet=True)
    run_id = first["worker-0"]["run"]
    assert processes_of_run(run_id)  # the idle cluster waits for the next call
    distlaunch.close_pool()
    assert not processes_of_run(run_id)
    assert json.loads((here / "runs" / run_id / "run.json").read_text())["state"] == "succeeded"
    second = distlaunch.run(interpreter_only, "second", quiet=True)
    assert second["worker-0"]["run"] != run_id
    assert set(tokens(second).values()).isdisjoint(tokens(first).values())
    distlaunch.close_pool()
    distlaunch.close_pool()  # nothing left to close: no error


def test_consecutive_calls_reuse_the_same_task_processes(here, capsys):
    first = distlaunch.run(interpreter, "first")
    run_id = first["worker-0"]["run"]
    pids = {p.pid for p in processes_of_run(run_id)}
    second = distlaunch.run(interpreter, "second")
    third = distlaunch.run(interpreter, "third", quiet=True)
    assert tokens(second) == tokens(third) == tokens(first)
    assert len(set(tokens(first).values())) == 2  # two interpreters, one per task
    assert {v["run"] for v in (*second.values(), *third.values())} == {run_id}
    assert {p.pid for p in processes_of_run(run_id)} == pids
    out = capsys.readouterr().out
    for label in ("first", "second"):
        assert f"worker-0 | {label} on task 0" in out and f"worker-1 | {label} on task 1" in out
    assert "third on task" not in out  # quiet, for this call only
    assert "call 1 done" not in out  # the pool's own line is not the user's output
    # ...and the run dir keeps every call's lines.
    log = (here / "runs" / run_id / "logs/attempt-0/worker-1.log").read_text()
    assert "first on task 1" in log and "third on task 1" in log

    # The pool off: a cluster of its own, new interpreters.
    cold = distlaunch.run(interpreter_only, "cold", pool=False)
    assert set(tokens(cold).values()).isdisjoint(tokens(first).values())
    assert cold["worker-0"]["run"] != run_id
    assert processes_of_run(cold["worker-0"]["run"]) == []  # a one-shot run ends with its call


@pytest.mark.quick
def test_closing_the_pool_ends_its_run_as_a_one_shot_call_ends(here):
    # Its tasks return at the close (no TERM for TensorFlow to swallow, no grace waited out):
    # the run succeeds, as a one-shot call's does, and nothing of it is left.
    values = distlaunch.run(interpreter_only, "once", quiet=True)
    run_dir = here / "runs" / values["worker-0"]["run"]
    api_pool.close()
    record = json.loads((run_dir / "run.json").read_text())
    assert record["state"] == "succeeded", record
    assert {t["exit_code"] for t in record["tasks"].values()} == {0}
    assert processes_of_run(record["run_id"]) == []


def test_the_environment_variable_turns_the_pool_off(here, monkeypatch):
    monkeypatch.setenv(api_pool.POOL_ENV, "0")
    first = distlaunch.run(interpreter_only, "one", quiet=True)
    second = distlaunch.run(interpreter_only, "two", quiet=True)
    assert set(tokens(first).values()).isdisjoint(tokens(second).values())
    assert processes_of_run(first["worker-0"]["run"]) == []


class PoolTestError(Exception):
    pass


def raise_on_worker_1() -> None:
    if os.environ["DISTLAUNCH_INDEX"] == "1":
        raise PoolTestError("raised in a warm task")


def test_a_raising_call_raises_its_exception_and_the_next_call_starts_fresh(here):
    warm = distlaunch.run(interpreter_only, "warm", quiet=True)
    with pytest.raises(PoolTestError, match="raised in a warm task") as caught:
        distlaunch.run(raise_on_worker_1, quiet=True)
    assert type(caught.value.__cause__).__name__ == "RemoteTraceback"
    assert "raise PoolTestError" in str(caught.value.__cause__)
    run_id = warm["worker-0"]["run"]
    assert any(f"raised in task worker-1 of run {run_id}" in n for n in caught.value.__notes__)
    record = json.loads((here / "runs" / run_id / "run.json").read_text())
    assert record["state"] == "failed"
    assert processes_of_run(run_id) == []
    fresh = distlaunch.run(interpreter_only, "fresh", quiet=True)
    assert set(tokens(fresh).values()).isdisjoint(tokens(warm).values())
    assert fresh["worker-0"]["run"] != run_id


def test_sigkill_of_a_pool_task_during_a_call_raises_task_error(here):
    warm = distlaunch.run(interpreter_only, "warm", quiet=True)
    run_id = warm["worker-0"]["run"]

    def wait_forever():
        import time

        print("waiting in call 1", flush=True)
        time.sleep(600)

    call = start(wait_forever, quiet=True)
    assert call.run.run_id == run_id  # the warm cluster's
    wait_for(
        lambda: all("waiting in call 1" in call.run.logs(t) for t in ("worker-0", "worker-1")),
        "both tasks to start the call",
    )
    (row,) = [r for r in call.run.tasks if r["task"] == "worker-1"]
    os.kill(row["pid"], signal.SIGKILL)
    with pytest.raises(distlaunch.TaskError) as caught:
        call.result()
    line = json.loads((here / "runs" / run_id / "run.json").read_text())["failure"]["summary"]
    assert str(caught.value) == line
    assert line.startswith(f"run {run_id} failed: worker-1 signal SIGKILL after ")
    assert caught.value.failure.kind == "signal"
    again = distlaunch.run(interpreter_only, "again", quiet=True)
    assert again["worker-0"]["run"] != run_id
    assert set(tokens(again).values()).isdisjoint(tokens(warm).values())


CALLER = """
import sys
import distlaunch
from test_api_pool import interpreter_only

first = distlaunch.run(interpreter_only, "first", quiet=True)
distlaunch.run(interpreter_only, "second", quiet=True)
print(first["worker-0"]["run"], flush=True)
import time
time.sleep(600)
"""


def test_a_caller_killed_with_a_live_pool_leaves_nothing_behind(here):
    (here / "caller.py").write_text(CALLER)
    tests = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    with open(here / "caller.out", "w") as out:
        caller = subprocess.Popen(
            [sys.executable, "caller.py"], cwd=here, stdout=out, stderr=subprocess.STDOUT, env=env
        )
    try:
        run_id = wait_for(
            lambda: (here / "caller.out").read_text().strip(), "two warm calls", launcher=caller
        )
        run_dir = here / "runs" / run_id
        tasks = processes_of_run(run_id)
        assert len(tasks) >= 2  # the pool's tasks serve on after the calls
        # Each task's own network namespace (the run's): it must go with the tasks.
        namespaces = {os.readlink(f"/proc/{p.pid}/ns/net") for p in tasks}
        assert namespaces != {os.readlink("/proc/self/ns/net")}
    finally:
        caller.kill()
        caller.wait()
    # The launcher sees its caller end (its pidfd) and stops the run as on SIGTERM.
    wait_for(
        lambda: json.loads((run_dir / "run.json").read_text())["state"] == "interrupted",
        "the run to be stopped",
    )
    wait_for(lambda: processes_of_run(run_id) == [], "every process of the run to be gone")
    assert_nothing_left(run_dir)
    left = set()
    for proc in psutil.process_iter():
        try:
            left.add(os.readlink(f"/proc/{proc.pid}/ns/net"))
        except OSError:
            continue
    assert not namespaces & left, "a process still holds the run's network namespace"


def chief_steps(steps: int) -> dict[str, object]:
    """Runs on the chief of a PSS cluster: a strategy and a ClusterCoordinator made in this call
    (again, in a warm chief), ``steps`` steps on a variable held by the ps."""
    import uuid

    import tensorflow as tf

    token = os.__dict__.setdefault("pool_test_token", uuid.uuid4().hex)
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        total = tf.Variable(0.0)

    @tf.function
    def step():
        total.assign_add(1.0)

    for _ in range(steps):
        coordinator.schedule(step)
    coordinator.join()
    return {"token": token, "total": float(total.numpy())}


def test_pss_calls_reuse_the_chief_and_return_its_value(here):
    shape = {"workers": 1, "ps": 1, "chief": 1, "strategy": "parameter_server", "quiet": True}
    first = distlaunch.run(chief_steps, 2, **shape)
    second = distlaunch.run(chief_steps, 5, **shape)
    assert (first["total"], second["total"]) == (2.0, 5.0)
    assert first["token"] == second["token"]
    (run_json,) = here.glob("runs/*/run.json")  # one cluster served both calls
    assert json.loads(run_json.read_text())["strategy"] == "parameter_server"


def late_leader(size: int) -> float:
    """worker-0 (the collective leader) makes its strategy last; the all-reduce's shape differs
    from call to call."""
    import time

    import tensorflow as tf

    if os.environ["DISTLAUNCH_INDEX"] == "0":
        time.sleep(0.3)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = strategy.cluster_resolver.task_id
    value = strategy.run(lambda: tf.fill([size], task + 1.0))
    return float(tf.reduce_sum(strategy.reduce("SUM", value, axis=None)))


def test_a_peer_that_makes_its_strategy_first_waits_for_the_others(here):
    # Without the barrier the early task's all-reduce reached the leader's collective state of
    # the previous call, and call 1 failed ("Collective ops is aborted by: Shape ...").
    values = [distlaunch.run(late_leader, size, quiet=True) for size in (1, 2, 3, 4)]
    assert values == [{"worker-0": 3.0 * s, "worker-1": 3.0 * s} for s in (1, 2, 3, 4)]
    (run_json,) = here.glob("runs/*/run.json")  # all on one warm cluster
