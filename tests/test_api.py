"""The Python API (`import distlaunch`): launch/up of a spec, and run(fn) on real TensorFlow tasks
(plain interpreters where the test is about the call, not the strategy).

Every test checks that nothing of its runs is left: no process with the run id in its
environment, no launcher process, no socket on a task's port.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

import distlaunch
from conftest import processes_of_run, wait_for, write_spec
from distlaunch.launcher.spec.model import Spec

pytestmark = pytest.mark.integration


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory of its own (run() puts its runs under ./runs), every call with a
    cluster of its own (the warm pool off: tests/test_api_pool.py tests it); on the way out,
    every run made under it must have left nothing running."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DISTLAUNCH_POOL", "0")
    before = set(psutil.Process().children(recursive=True))
    yield tmp_path
    for run_json in tmp_path.glob("**/runs/*/run.json"):
        assert_nothing_left(run_json.parent)
    launchers = [p for p in psutil.Process().children(recursive=True) if p not in before]
    assert not [p for p in launchers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def assert_nothing_left(run_dir: Path) -> None:
    """No process of the run, and no socket on any of its tasks' ports."""
    record = json.loads((run_dir / "run.json").read_text())
    assert processes_of_run(record["run_id"]) == []
    ports = {t["port"] for t in record["tasks"].values()}
    used = {c.laddr.port for c in psutil.net_connections("inet") if c.laddr}
    assert not ports & used, f"ports of {record['run_id']} still in use: {ports & used}"


def only_run(folder: Path) -> Path:
    (run_json,) = folder.glob("runs/*/run.json")
    return run_json.parent


# ---- import and bad input -------------------------------------------------------------------


@pytest.mark.quick
def test_import_is_cheap_and_names_are_exported():
    code = (
        "import json, sys, distlaunch; "
        "heavy = lambda: [m for m in ('tensorflow', 'pydantic', 'click', 'cloudpickle') if m in sys.modules]; "
        "at_import = heavy(); distlaunch.run, distlaunch.launch; "
        "print(json.dumps([at_import, heavy(), sorted(distlaunch.__all__)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    at_import, with_the_api, names = json.loads(out.stdout)
    assert at_import == []
    # Starting a run loads no launcher module here (no pydantic, no click): the launcher
    # process does; only cloudpickle, for the function.
    assert with_the_api == ["cloudpickle"]
    for name in ("launch", "up", "run", "Run", "RunResult", "SpecError", "RunFailed", "TaskError"):
        assert name in names
        assert getattr(distlaunch, name) is not None
    # Every error the docstrings name is exported, as the class that is raised.
    from distlaunch.launcher.core.errors import UsageError

    assert "UsageError" in names and distlaunch.UsageError is UsageError


@pytest.mark.quick
def test_bad_spec_raises_spec_error_and_starts_nothing(here):
    spec = write_spec(here, tasks={"worker": {"count": "two"}})
    with pytest.raises(distlaunch.SpecError) as caught:
        distlaunch.launch(spec)
    assert str(caught.value) == f'{spec}: $.tasks.worker.count: expected an integer, got "two"'
    with pytest.raises(distlaunch.SpecError, match=r"^<spec>: \$\.strategy: "):
        distlaunch.up({"name": "x", "strategy": "nope", "program": {"module": "m"}, "tasks": {}})
    assert not (here / "runs").exists()


@pytest.mark.quick
def test_unpicklable_argument_fails_before_anything_starts(here):
    lock = threading.Lock()
    with pytest.raises(distlaunch.PicklingError) as caught:
        distlaunch.run(lambda x, y: None, 1, lock)
    assert str(caught.value) == (
        "distlaunch.run: cannot pickle argument 1 (a lock): cannot pickle '_thread.lock' object; "
        "nothing was started"
    )
    with pytest.raises(distlaunch.PicklingError, match="cannot pickle the function .*<lambda>"):
        distlaunch.run(lambda: lock)
    with pytest.raises(distlaunch.PicklingError, match="keyword argument 'opt' \\(a lock\\)"):
        distlaunch.run(print, opt=lock)
    assert not (here / "runs").exists()


# ---- run(fn) on real TensorFlow tasks ------------------------------------------------------


def test_run_returns_every_workers_value_and_streams_their_lines(here, capsys):
    scale = 10.0  # a closure's value travels with the function

    def all_reduce():
        import tensorflow as tf

        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        task = strategy.cluster_resolver.task_id
        print(f"task {task} has its strategy", flush=True)
        total = strategy.reduce(
            "SUM", strategy.run(lambda: tf.constant(float(task + 1) * scale)), axis=None
        )
        return {"task": task, "sum": float(total), "tf_config": os.environ["TF_CONFIG"]}

    values = distlaunch.run(all_reduce)
    assert list(values) == ["worker-0", "worker-1"]
    assert [v["task"] for v in values.values()] == [0, 1]
    assert [v["sum"] for v in values.values()] == [30.0, 30.0]
    assert json.loads(values["worker-1"]["tf_config"])["task"] == {"type": "worker", "index": 1}
    out = capsys.readouterr().out
    assert "worker-0 | task 0 has its strategy" in out
    assert "worker-1 | task 1 has its strategy" in out
    # ...and the run dir keeps them.
    run_dir = only_run(here)
    assert "task 1 has its strategy" in (run_dir / "logs/attempt-0/worker-1.log").read_text()


@pytest.mark.quick
def test_quiet_keeps_output_in_the_run_dir_only(here, capsys):
    assert distlaunch.run(lambda: print("hello from a task"), workers=1, quiet=True) == {
        "worker-0": None
    }
    assert "hello from a task" not in capsys.readouterr().out
    assert "hello from a task" in (only_run(here) / "logs/attempt-0/worker-0.log").read_text()


class StepFailed(Exception):
    """Defined in the test module: unpickles in the caller by reference."""


@pytest.mark.quick
def test_a_tasks_exception_is_raised_as_itself_with_its_traceback(here):
    def step():  # no TensorFlow: the exception's way back is the call's own
        if os.environ["DISTLAUNCH_INDEX"] == "1":
            raise StepFailed("loss is nan at step 7")
        return "fine"

    with pytest.raises(StepFailed, match="^loss is nan at step 7") as caught:
        distlaunch.run(step)
    exc = caught.value
    run_dir = only_run(here)
    assert f"distlaunch.run: raised in task worker-1 of run {run_dir.name}" in exc.__notes__[0]
    cause = exc.__cause__
    assert type(cause).__name__ == "RemoteTraceback"
    assert 'raise StepFailed("loss is nan at step 7")' in str(cause)
    assert "test_api.StepFailed: loss is nan at step 7" in str(cause)


class NeedsTwoArgs(Exception):
    """Pickles, but its unpickling calls NeedsTwoArgs(message) and fails."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@pytest.mark.quick
def test_an_exception_that_does_not_unpickle_becomes_task_error(here):
    def step():
        raise NeedsTwoArgs("disk quota", 28)

    with pytest.raises(distlaunch.TaskError) as caught:
        distlaunch.run(step, workers=1)
    exc = caught.value
    assert exc.task == "worker-0"
    assert exc.type_name == "test_api.NeedsTwoArgs"
    assert str(exc).startswith("worker-0 raised test_api.NeedsTwoArgs: disk quota")
    assert 'raise NeedsTwoArgs("disk quota", 28)' in exc.traceback_text
    assert exc.failure.kind == "exception" and exc.failure.exit_code == 1


@pytest.mark.quick
def test_an_unpicklable_return_value_names_the_task_and_the_type(here):
    with pytest.raises(distlaunch.PicklingError) as caught:
        distlaunch.run(lambda: threading.Lock(), workers=1)
    assert str(caught.value).startswith(
        "distlaunch.run: worker-0 returned a _thread.lock, which cannot be pickled: "
    )


@pytest.mark.quick
def test_a_task_killed_during_the_run_raises_task_error_with_the_root_cause(here):
    from distlaunch.launcher.api.call import start

    def wait_forever():  # no TensorFlow: the kill and its root cause are the launcher's
        import time

        print("joined", flush=True)
        time.sleep(600)

    call = start(wait_forever, quiet=True)
    run_dir = call.run.run_dir
    try:
        wait_for(
            lambda: all("joined" in call.run.logs(t) for t in ("worker-0", "worker-1")),
            "both workers to join",
        )
        (row,) = [r for r in call.run.tasks if r["task"] == "worker-1"]
        os.kill(row["pid"], signal.SIGKILL)
        with pytest.raises(distlaunch.TaskError) as caught:
            call.result()
    finally:
        call.run.stop()
    exc = caught.value
    line = json.loads((run_dir / "run.json").read_text())["failure"]["summary"]
    assert str(exc) == line
    assert line.startswith(f"run {run_dir.name} failed: worker-1 signal SIGKILL after ")
    assert exc.failure.kind == "signal" and exc.failure.signal == "SIGKILL"


def chief_step(steps: int) -> float:
    """Runs on the chief of a PSS cluster: builds the strategy, schedules ``steps`` steps that
    each add 1 to a variable held by a ps. Module level: pickled by reference, imported again in
    the task through the caller's sys.path."""
    import tensorflow as tf

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
    return float(total.numpy())


def test_pss_runs_on_the_chief_and_returns_its_value(here, capsys):
    value = distlaunch.run(
        chief_step, 5, workers=2, ps=1, chief=1, strategy="parameter_server", timeout_s=300
    )
    assert value == 5.0
    out = capsys.readouterr().out
    assert "serving at" in out  # the ps and worker tasks ran servers, not the function


# ---- launch / up of a spec ------------------------------------------------------------------

TASK = """
import os, sys
print("task", os.environ["DISTLAUNCH_INDEX"], flush=True)
if os.environ["DISTLAUNCH_INDEX"] == "1" and "--fail" in sys.argv:
    raise KeyError("no such column: label")
"""


def test_up_returns_the_result_and_raises_run_failed_with_the_failure(here):
    (here / "task.py").write_text(TASK)
    spec = write_spec(here)
    result = distlaunch.up(str(spec), console=None)
    assert result.ok and result.state == "succeeded" and result.exit_code == 0
    assert result.failure is None
    # The typed spec runs too (relative paths against the working directory, here).
    typed = Spec.model_validate(json.loads(spec.read_text()))
    assert distlaunch.up(typed, console=None).ok

    with pytest.raises(distlaunch.RunFailed) as caught:
        distlaunch.up(spec, overrides=['program.args=["--fail"]'], console=None)
    failure = caught.value.failure
    assert caught.value.result.state == "failed" and caught.value.result.exit_code == 1
    assert failure.kind == "exception" and failure.task == "worker-1"
    assert failure.exit_code == 1 and failure.signal is None
    assert failure.exception_type == "KeyError" and failure.message == "'no such column: label'"
    assert 'raise KeyError("no such column: label")' in failure.traceback
    assert str(caught.value) == failure.summary
    assert failure.summary.startswith(f"run {Path(caught.value.run_dir).name} failed: worker-1 ")


@pytest.mark.quick
def test_launch_gives_a_handle_to_watch_and_stop_the_run(here, request):
    (here / "task.py").write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    lines: list[str] = []

    class Sink:
        def write(self, text: str) -> None:
            lines.append(text)

        def flush(self) -> None:
            pass

    run = distlaunch.launch({**json.loads(write_spec(here).read_text())}, console=Sink())
    request.addfinalizer(run.stop)
    assert run.run_dir.parent == here / "runs"
    wait_for(
        lambda: (
            run.state == "running" and all("up" in run.logs(t) for t in ("worker-0", "worker-1"))
        ),
        "both tasks up",
    )
    assert [r["task"] for r in run.tasks] == ["worker-0", "worker-1"]
    assert all(psutil.pid_exists(r["pid"]) for r in run.tasks)
    with pytest.raises(TimeoutError):
        run.wait(timeout=0.1)
    assert run.result is None
    result = run.stop()
    assert result.state == "interrupted" and result.exit_code == 128 + signal.SIGTERM
    assert run.state == "interrupted"
    assert any(line.startswith("worker-1 | up") for line in lines), lines


# ---- the caller goes: the run goes with it ---------------------------------------------------

CALLER = """
import sys
import distlaunch

def wait_forever():
    import time
    print("joined", flush=True)
    time.sleep(600)

try:
    distlaunch.run(wait_forever)
except KeyboardInterrupt:
    print("caller: interrupted", flush=True)
    sys.exit(130)
"""


def _start_caller(folder: Path) -> tuple[subprocess.Popen, Path]:
    """A Python program calling distlaunch.run, once both its tasks are up; and its run dir."""
    (folder / "caller.py").write_text(CALLER)
    with open(folder / "caller.out", "w") as out:
        caller = subprocess.Popen(
            [sys.executable, "caller.py"], cwd=folder, stdout=out, stderr=subprocess.STDOUT
        )
    wait_for(
        lambda: (
            len(
                [p for p in folder.glob("runs/*/logs/attempt-0/*.log") if "joined" in p.read_text()]
            )
            == 2
        ),
        "both tasks of the caller's run to start",
        launcher=caller,
    )
    return caller, only_run(folder)


@pytest.mark.quick
def test_ctrl_c_in_the_caller_stops_the_run(here):
    caller, run_dir = _start_caller(here)
    caller.send_signal(signal.SIGINT)
    assert caller.wait(120) == 130
    out = (here / "caller.out").read_text()
    assert "caller: interrupted" in out
    assert "interrupted by SIGTERM" not in out  # the Ctrl-C is the caller's, not a SIGTERM
    assert json.loads((run_dir / "run.json").read_text())["state"] == "interrupted"


@pytest.mark.quick
def test_a_caller_killed_outright_leaves_no_task_behind(here):
    caller, run_dir = _start_caller(here)
    caller.kill()
    caller.wait()
    # The launcher sees its caller end (a pidfd) and stops the run as on SIGTERM.
    wait_for(
        lambda: json.loads((run_dir / "run.json").read_text())["state"] == "interrupted",
        "the run to be stopped",
    )
    run_id = run_dir.name
    wait_for(lambda: processes_of_run(run_id) == [], "every process of the run to be gone")


# ---- run(fn, spec=...) on SSH test hosts -----------------------------------------------------


def test_run_with_a_spec_of_ssh_hosts_returns_every_tasks_value(ssh_lab, here):
    node1, node2 = ssh_lab.hosts
    spec = {
        "name": "ssh-call",
        "strategy": "multi_worker_mirrored",
        "program": {"module": "replaced.by.run"},
        "hosts": {h.name: ssh_lab.host_entry(h) for h in ssh_lab.hosts},
        "tasks": {"worker": [{"host": node1.name}, {"host": node2.name}]},
        "shared_dir": "runs",
        "timeouts": {"grace_s": 2, "startup_s": 120},
    }

    def where(x):
        import tensorflow as tf

        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        task = strategy.cluster_resolver.task_id
        value = strategy.run(lambda: tf.constant(x + task))
        address = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"][task]
        return address.rsplit(":", 1)[0], float(strategy.reduce("SUM", value, axis=None))

    values = distlaunch.run(where, 1.0, spec=spec)
    assert values == {"worker-0": (node1.address, 3.0), "worker-1": (node2.address, 3.0)}
    assert not any(ssh_lab.processes(host) for host in ssh_lab.hosts)


# ---- run(fn, spec=...) on a Slurm cluster ----------------------------------------------------

SLURM_CALLER = """
import json, os, sys
import distlaunch

def where(x):
    import socket

    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = strategy.cluster_resolver.task_id
    value = strategy.run(lambda: tf.constant(x + task))
    return socket.gethostname(), float(strategy.reduce("SUM", value, axis=None))

print("values", json.dumps(distlaunch.run(where, 1.0, spec="spec.json", quiet=True)))
"""


def test_run_with_a_slurm_spec_inside_an_allocation(slurm_lab, here):
    spec = {
        "name": "slurm-call",
        "strategy": "multi_worker_mirrored",
        "backend": "slurm",
        "program": {"module": "replaced.by.run", "python": sys.executable},
        "tasks": {"worker": {"count": 2}},
        "shared_dir": "runs",
        "timeouts": {"grace_s": 2, "startup_s": 120},
    }
    (here / "spec.json").write_text(json.dumps(spec))
    (here / "caller.py").write_text(SLURM_CALLER)
    result = slurm_lab.run(
        ["salloc", "--nodes=2", "--quiet", sys.executable, "caller.py"], cwd=here, timeout=300
    )
    assert result.returncode == 0, result.stderr + result.stdout
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("values ")]
    node1, node2 = (n.name for n in slurm_lab.nodes)
    assert json.loads(line.removeprefix("values ")) == {
        "worker-0": [node1, 3.0],
        "worker-1": [node2, 3.0],
    }
    wait_for(
        lambda: not slurm_lab.steps() and not any(slurm_lab.processes(n) for n in slurm_lab.nodes),
        "no step or process left on any node",
        limit_s=30,
    )


def test_restarts_report_each_tasks_latest_attempt(here):
    def flaky(then_die):
        import os
        import signal

        attempt = int(os.environ["DISTLAUNCH_ATTEMPT"])
        if os.environ["DISTLAUNCH_INDEX"] == "1":
            if attempt == 0:
                raise RuntimeError("first attempt fails")
            if then_die:
                os.kill(os.getpid(), signal.SIGKILL)
        return attempt

    restart = {"policy": "on-failure", "max_restarts": 1, "backoff": {"initial_s": 0.1}}
    # The gang restarts after worker-1's exception; both values are the second attempt's.
    assert distlaunch.run(flaky, False, restart=restart, quiet=True) == {
        "worker-0": 1,
        "worker-1": 1,
    }
    # A second attempt killed outright: its signal is the failure, not attempt 0's exception.
    with pytest.raises(distlaunch.TaskError, match="worker-1 signal SIGKILL") as caught:
        distlaunch.run(flaky, True, restart=restart, quiet=True)
    assert caught.value.failure.kind == "signal"


@pytest.mark.quick
def test_a_host_that_fails_its_check_raises_start_error_and_starts_nothing(ssh_lab, here):
    node1, node2 = ssh_lab.hosts
    spec = {
        "name": "ssh-bad",
        "strategy": "multi_worker_mirrored",
        "program": {"module": "replaced.by.run"},
        "hosts": {
            node1.name: ssh_lab.host_entry(node1),
            node2.name: ssh_lab.host_entry(node2, python="/nonexistent/python3"),
        },
        "tasks": {"worker": [{"host": node1.name}, {"host": node2.name}]},
        "shared_dir": "runs",
    }
    with pytest.raises(distlaunch.StartError) as caught:
        distlaunch.run(print, spec=spec, quiet=True)
    assert node2.name in str(caught.value) and "/nonexistent/python3" in str(caught.value)
    assert not list(here.glob("runs/*/run.json"))
    assert not any(ssh_lab.processes(host) for host in ssh_lab.hosts)


def test_env_reaches_every_task_and_timeout_s_ends_a_run_that_hangs(here):
    def read(name):
        import os

        return os.environ[name]

    values = distlaunch.run(read, "MY_SETTING", env={"MY_SETTING": "on"}, quiet=True)
    assert values == {"worker-0": "on", "worker-1": "on"}

    def hang():
        import time

        time.sleep(600)

    with pytest.raises(
        distlaunch.TaskError, match=r"time limit of 2 s \(timeouts\.run_s\)"
    ) as caught:
        distlaunch.run(hang, workers=1, timeout_s=2, quiet=True)
    assert caught.value.failure.kind == "timeout"
