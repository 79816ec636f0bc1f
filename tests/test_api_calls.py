"""`distlaunch.run` as users call it: functions that print without newlines or from threads that
keep printing, tasks that exit cleanly mid-call, Ctrl-C at any moment, fork, a caller's changing
environment and working directory, argv, large arguments, our errors through pickle (issue 39).

The tasks here import no TensorFlow: each of these is about the call's own protocol, and a
task of `distlaunch.run` is a plain interpreter until its function makes a strategy.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import psutil
import pytest

import distlaunch
from conftest import processes_of_run, wait_for
from distlaunch.launcher.api import launch as api_launch
from distlaunch.launcher.api import pool as api_pool
from distlaunch.launcher.api.call import start
from test_api import assert_nothing_left

pytestmark = pytest.mark.integration


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A working directory of its own, the pool on; on the way out the pool is closed and no
    run made under it may have left anything running."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(api_pool.POOL_ENV, raising=False)
    yield tmp_path
    api_pool.close()
    for run_json in tmp_path.glob("runs/*/run.json"):
        assert_nothing_left(run_json.parent)


# A bound on each call, so that a hang fails the test instead of holding it: no call here takes
# more than a few seconds.
CALL_S = 120


def _task() -> int:
    return int(os.environ["DISTLAUNCH_INDEX"])


def chatty(i: int) -> int:
    """Prints with and without newlines, as the old done line, from a thread that keeps
    printing (started once per interpreter); one task of call 50 exits cleanly mid-call."""
    if getattr(os, "chatty_thread", None) is None:

        def tick() -> None:
            n = 0
            while True:
                print(f"tick {n}", end="" if n % 2 else "\n", flush=True)
                n += 1
                time.sleep(0.005)

        os.chatty_thread = threading.Thread(target=tick, daemon=True)  # type: ignore[attr-defined]
        os.chatty_thread.start()  # type: ignore[attr-defined]
    if i % 3 == 0:
        print(f"call {i} without a newline", end="", flush=True)
    elif i % 3 == 1:
        sys.stdout.write(f"distlaunch.run: call {i} done")  # what the pool used to look for
        sys.stdout.flush()
    else:
        print(f"call {i}")
    if i == 50 and _task() == 0:
        sys.exit(0)
    return i


def test_a_hundred_pooled_calls_of_printing_functions_each_return_or_raise(here):
    raised = []
    for i in range(100):
        call = start(chatty, i, quiet=i % 2 == 0)
        try:
            values = call.result(timeout=CALL_S)  # TimeoutError: a hang, the test fails
        except distlaunch.TaskError as exc:
            raised.append((i, str(exc)))
            continue
        assert values == {"worker-0": i, "worker-1": i}
    assert len(raised) == 1 and raised[0][0] == 50
    assert raised[0][1].startswith("worker-0 exited with status 0 before returning")
    # Two clusters: the first until call 50, a new one after it.
    assert len(list(here.glob("runs/*/run.json"))) == 2


def exits(how: str) -> int:
    if _task() == 0:
        if how == "sys.exit":
            sys.exit(0)
        if how == "os._exit":
            sys.stdout.flush()
            os._exit(0)
        if how == "sys.exit(3)":
            sys.exit(3)
    return 1


@pytest.mark.parametrize("pool", [True, False], ids=["pooled", "one-shot"])
def test_a_task_that_exits_mid_call_raises_task_error_naming_it(here, pool):
    for how, status in (("sys.exit", 0), ("os._exit", 0), ("sys.exit(3)", 3)):
        with pytest.raises(distlaunch.TaskError) as caught:
            start(exits, how, pool=pool).result(timeout=CALL_S)
        assert str(caught.value).startswith(
            f"worker-0 exited with status {status} before returning"
        ), how
        assert caught.value.task == "worker-0"
    assert distlaunch.run(exits, "no", pool=pool) == {"worker-0": 1, "worker-1": 1}


@pytest.mark.quick
def test_a_task_that_exits_before_the_caller_listens_still_raises(here, monkeypatch):
    """A task that says ``open`` on its done FIFO and exits before the caller opened that FIFO
    takes the word with it: the caller, made to open it only once the task's exit is recorded,
    must still learn that the task ended (it waited for the word for ever before)."""
    real_open = api_pool._Channel.open

    def late_open(channel: api_pool._Channel) -> None:
        if channel.fd is None and not channel.opened:
            run_dir = channel.path.parents[2]  # RUN/call/done/TASK
            task = channel.path.name
            wait_for(
                lambda: (
                    api_pool.api.reads().exit_code_of(run_dir, task) is not None
                    or task != "worker-0"
                ),
                "worker-0's exit to be recorded",
                limit_s=CALL_S,
            )
        real_open(channel)

    monkeypatch.setattr(api_pool._Channel, "open", late_open)
    with pytest.raises(distlaunch.TaskError) as caught:
        start(exits, "os._exit", pool=True).result(timeout=CALL_S)
    assert str(caught.value).startswith("worker-0 exited with status 0 before returning")


def ticks() -> str:
    """Starts a thread that prints a line every 10 ms for good, and returns."""

    def tick() -> None:
        while True:
            print("tick between calls", flush=True)
            time.sleep(0.01)

    threading.Thread(target=tick, daemon=True).start()
    return "ticking"


def test_nothing_reaches_the_caller_between_calls_and_no_server_deadline(here, capsys):
    assert distlaunch.run(ticks, workers=1) == {"worker-0": "ticking"}
    capsys.readouterr()
    time.sleep(1.0)  # the thread prints about a hundred lines meanwhile
    assert "tick" not in capsys.readouterr().out
    (run_json,) = here.glob("runs/*/run.json")
    log = (run_json.parent / "logs/attempt-0/worker-0.log").read_text()
    assert log.count("tick between calls") > 10  # ...into the run dir
    # A function that never makes a strategy is not killed for it (timeouts.startup_s).
    record = json.loads(run_json.read_text())
    assert record["spec"]["timeouts"]["startup_s"] is None  # null: no deadline


def sees() -> tuple[str | None, str, list[str]]:
    return os.environ.get("DL_TEST_DATA"), os.getcwd(), list(sys.argv)


def wanders() -> None:
    os.chdir("/")
    os.environ["DL_TEST_DATA"] = "the task's own"
    sys.argv.append("--extra")


def parses() -> dict[str, object]:
    """A script's main() with argparse, wrapped in a function."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.1)
    return vars(parser.parse_args())


def test_a_pooled_call_sees_what_a_one_shot_call_sees(here, monkeypatch):
    monkeypatch.setenv("DL_TEST_DATA", "first")
    first = distlaunch.run(sees)
    assert first["worker-0"][0] == "first"
    distlaunch.run(wanders)
    monkeypatch.setenv("DL_TEST_DATA", "second")
    pooled = distlaunch.run(sees)
    one_shot = distlaunch.run(sees, pool=False)
    assert pooled == one_shot
    assert pooled["worker-1"][:2] == ("second", str(here))
    assert distlaunch.run(parses) == {"worker-0": {"lr": 0.1}, "worker-1": {"lr": 0.1}}
    monkeypatch.delenv("DL_TEST_DATA")
    assert distlaunch.run(sees)["worker-0"][0] is None


def leaves_a_thread() -> int:
    threading.Thread(target=time.sleep, args=(3600,)).start()  # not a daemon
    return 7


@pytest.mark.quick
def test_a_one_shot_call_returns_when_its_function_returns(here):
    call = start(leaves_a_thread, pool=False)
    assert call.result(timeout=CALL_S) == {"worker-0": 7, "worker-1": 7}
    assert processes_of_run(call.run.run_id) == []


def returns_foreign(folder: str) -> object:
    sys.path.insert(0, folder)
    import dl_foreign_module  # only the task can import it

    return dl_foreign_module.Thing()


@pytest.mark.quick
def test_a_return_value_that_does_not_unpickle_names_the_task(here):
    folder = here / "task_only"
    folder.mkdir()
    (folder / "dl_foreign_module.py").write_text("class Thing:\n    pass\n")
    with pytest.raises(distlaunch.PicklingError) as caught:
        distlaunch.run(returns_foreign, str(folder), workers=1)
    assert "the return value of worker-0 does not unpickle here" in str(caught.value)
    assert "dl_foreign_module" in str(caught.value)


def test_a_calls_files_are_removed_once_read_unless_kept(here):
    big = b"x" * (8 << 20)
    assert distlaunch.run(len, big) == {"worker-0": len(big), "worker-1": len(big)}
    assert distlaunch.run(len, big) == {"worker-0": len(big), "worker-1": len(big)}
    distlaunch.run(len, big, pool=False)
    for run_json in here.glob("runs/*/run.json"):
        call = run_json.parent / "call"
        assert not [p for p in call.rglob("*.pkl")], sorted(call.rglob("*.pkl"))
    distlaunch.run(len, big, keep=True, pool=False)
    kept = {p.name for p in here.glob("runs/*/call/**/*.pkl")}
    assert kept == {"payload.pkl", "worker-0.pkl", "worker-1.pkl"}


@pytest.mark.quick
def test_ctrl_c_while_the_launcher_answers_leaves_nothing_running(here, monkeypatch):
    real = api_launch.reads
    pressed = []

    def ctrl_c_now():  # the user's Ctrl-C arrives while the launcher reads the request
        if not pressed:
            pressed.append(True)
            signal.raise_signal(signal.SIGINT)
        return real()

    monkeypatch.setattr(api_launch, "reads", ctrl_c_now)
    before = set(psutil.Process().children())
    with pytest.raises(KeyboardInterrupt):
        distlaunch.run(time.sleep, 30)
    _assert_nothing_running(here, before)


@pytest.mark.quick
def test_ctrl_c_before_the_pool_holds_its_new_run_leaves_nothing_running(here, monkeypatch):
    real = api_pool._Entry.__init__

    def ctrl_c_now(self, *args):  # the run is made, the pool does not hold it yet
        monkeypatch.setattr(api_pool._Entry, "__init__", real)
        signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(api_pool._Entry, "__init__", ctrl_c_now)
    before = set(psutil.Process().children())
    with pytest.raises(KeyboardInterrupt):
        distlaunch.run(time.sleep, 30)
    _assert_nothing_running(here, before)
    assert distlaunch.run(len, "abc") == {"worker-0": 3, "worker-1": 3}  # the pool starts anew


def _assert_nothing_running(here: Path, before: set[psutil.Process]) -> None:
    launchers = [p for p in psutil.Process().children() if p not in before]
    assert not [p for p in launchers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for run_json in here.glob("runs/*/run.json"):
        assert_nothing_left(run_json.parent)


def run_id() -> str:
    return os.environ["DISTLAUNCH_RUN_ID"]


def test_a_process_forked_after_a_pooled_call_has_a_pool_of_its_own(here):
    parent = distlaunch.run(run_id, quiet=True)
    pid = os.fork()
    if pid == 0:  # the child: a call of its own, then what its interpreter's exit runs
        code = 1
        try:
            (here / "child.json").write_text(json.dumps(distlaunch.run(run_id, quiet=True)))
            distlaunch.close_pool()
            api_launch._stop_live_runs()
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + CALL_S
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        time.sleep(0.05)
    child = json.loads((here / "child.json").read_text())
    assert child["worker-0"] != parent["worker-0"]  # not the parent's cluster
    assert processes_of_run(child["worker-0"]) == []  # the child's ended with it
    # The child stopped nothing of the parent's: its warm cluster serves the next call.
    assert distlaunch.run(run_id, quiet=True) == parent


CALLER_FORKS = """
import os, time
import distlaunch

def run_id():
    return os.environ["DISTLAUNCH_RUN_ID"]

first = distlaunch.run(run_id, quiet=True)
child = os.fork()
if child == 0:  # a forked child (a data loader, a multiprocessing worker) lives on
    time.sleep(600)
    os._exit(0)
print(first["worker-0"], child, flush=True)
time.sleep(600)
"""


@pytest.mark.quick
def test_a_sigkilled_caller_stops_its_cluster_while_its_forked_child_lives(here):
    (here / "caller.py").write_text(CALLER_FORKS)
    with open(here / "caller.out", "w") as out:
        caller = subprocess.Popen(
            [sys.executable, "caller.py"], cwd=here, stdout=out, stderr=subprocess.STDOUT
        )
    child = None
    try:
        line = wait_for(lambda: (here / "caller.out").read_text().strip(), "a warm call", 120)
        run, child = line.split()[0], int(line.split()[1])
        assert processes_of_run(run)
        caller.kill()
        caller.wait()
        assert psutil.pid_exists(child)
        wait_for(lambda: processes_of_run(run) == [], "the run's tasks to be gone", 120)
        assert_nothing_left(here / "runs" / run)
    finally:
        caller.kill()
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _raise(kind: str) -> None:
    from distlaunch.launcher.api.results import Failure, FailureKind, RunResult
    from distlaunch.launcher.core.errors import HostError, Interrupted, UsageError

    failure = Failure(FailureKind.EXIT, "worker-1", "run r failed: worker-1 exit code 3", "x")
    errors = {
        "TaskError": distlaunch.TaskError(
            "worker-1 died", task="worker-1", run_dir="/r", failure=failure, type_name="E"
        ),
        "RunFailed": distlaunch.RunFailed("r failed", RunResult("failed", 1, failure), "/r"),
        "SpecError": distlaunch.SpecError("spec.json", "$.tasks", "expected a mapping"),
        "StartError": distlaunch.StartError("host h: unreachable"),
        "UsageError": UsageError("no task worker-9"),
        "PicklingError": distlaunch.PicklingError("cannot pickle argument 0"),
        "HostError": HostError("hosts failed", ["h1: down"]),
        "Interrupted": Interrupted(signal.SIGTERM),
    }
    error = errors[kind]
    error.add_note("a note")
    raise error


@pytest.mark.quick
@pytest.mark.parametrize(
    "kind",
    [
        "TaskError",
        "RunFailed",
        "SpecError",
        "StartError",
        "UsageError",
        "PicklingError",
        "HostError",
        "Interrupted",
    ],
)
def test_our_errors_come_back_whole_through_a_process_pool(kind):
    with ProcessPoolExecutor(1) as executor:
        with pytest.raises(distlaunch.LaunchError) as caught:
            executor.submit(_raise, kind).result(timeout=CALL_S)
    error = caught.value
    assert type(error).__name__ == kind
    assert error.__notes__ == ["a note"]
    if kind == "TaskError":
        assert (error.task, error.run_dir, error.type_name) == ("worker-1", "/r", "E")
        assert error.failure.task == "worker-1" and str(error) == "worker-1 died"
    if kind == "RunFailed":
        assert error.result.state == "failed" and error.failure.task == "worker-1"
    if kind == "SpecError":
        assert (error.file, error.json_path) == ("spec.json", "$.tasks")
        assert str(error) == "spec.json: $.tasks: expected a mapping"
    if kind == "Interrupted":
        assert error.exit_code == 128 + signal.SIGTERM


@pytest.mark.quick
def test_a_run_stopped_right_after_launch_is_interrupted_not_failed(here):
    (here / "idle.py").write_text("import time\ntime.sleep(600)\n")
    spec = {"name": "idle", "strategy": "multi_worker_mirrored", "program": {"script": "idle.py"}}
    run = distlaunch.launch({**spec, "tasks": {"worker": {"count": 1}}}, console=None)
    result = run.stop()
    assert (result.state, result.exit_code) == ("interrupted", 128 + signal.SIGTERM)
