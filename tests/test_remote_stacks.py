"""Stacks read where a task runs: the remote helper's stacks query (and its faulthandler fallback,
which signals the task's own program only), the watchdog's capture on SSH hosts and on a Slurm
cluster, and `distlaunch stacks` on Slurm and compose runs, which must leave the run running.

Before this, every capture read the local ssh/srun/compose client standing for a remote task:
py-spy failed on it, and the fallback's SIGUSR2 to that client ended it and the task with it.
A task that goes silent here keeps no thread printing, while its peers (and an evaluator) print:
the watchdog fires on it alone, and a healthy task that got a signal would show (an exit, or a
faulthandler dump in RUN/stacks/signal-attempt-N/).
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

from conftest import REPO, events, run_record, wait_for, wait_for_run_dir
from distlaunch.host import bootstrap
from distlaunch.launcher.diagnosis import stacks
from test_compose import _env, _leftovers, _start_up, engine, image  # noqa: F401 (fixtures)

# py-spy is not beside this interpreter nor on this PATH: the helper must fall back.
SYSTEM_PYTHON = "/usr/bin/python3"
HELPER_BY_PATH = [SYSTEM_PYTHON, "-I", "-S", str(REPO / "launcher" / "host" / "remote.py")]

WAITER = """
import time

def wait_here():
    print("up", flush=True)
    time.sleep(600)

wait_here()
"""

# Two MWMS workers and an evaluator. Every task has a thread that prints each second; worker 1
# stops it and sleeps inside step 3, in its own code; worker 0 then waits in the step's
# all-reduce (its thread still printing), and the evaluator prints on.
CHATTY_HANG = """
import os, threading, time

index, role = int(os.environ["DISTLAUNCH_INDEX"]), os.environ["DISTLAUNCH_ROLE"]
quiet = threading.Event()


def chatter():
    while not quiet.is_set():
        print("alive", flush=True)
        time.sleep(1)


threading.Thread(target=chatter, daemon=True).start()
if role == "evaluator":
    while True:
        time.sleep(1)

import tensorflow as tf

strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    w = tf.Variable(1.0)


@tf.function
def train_step():
    def step():
        return tf.distribute.get_replica_context().all_reduce("sum", w * 2.0)
    return strategy.run(step)


def train(steps):
    for i in range(steps):
        if index == 1 and i == 3:
            quiet.set()
            print("worker 1 stops inside step", i, flush=True)
            time.sleep(100000)
        train_step()
        print("step", i, "done", flush=True)


train(10**9)
"""
HANG_LINE = "train (task.py:38)"  # worker 1's time.sleep in CHATTY_HANG


def _query(run_id: str, task: str) -> bytes:
    return (
        json.dumps({"stacks": {"run_id": run_id, "task": task, "native": False}}).encode() + b"\n"
    )


def _task_env(run_dir: Path, run_id: str) -> dict[str, str]:
    return {
        "DISTLAUNCH_RUN_ID": run_id,
        "DISTLAUNCH_RUN_DIR": str(run_dir),
        "DISTLAUNCH_ROLE": "worker",
        "DISTLAUNCH_INDEX": "1",
        "DISTLAUNCH_ATTEMPT": "0",
    }


def _start_task(tmp: Path, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """A task started by the remote helper, as the SSH transport starts one; returns once it
    printed "up" (its faulthandler, if any, is in place by then)."""
    helper = subprocess.Popen(
        [sys.executable, "-m", "distlaunch.host.remote"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    request = {"argv": argv, "env": env, "cwd": str(tmp), "grace_s": 1}
    helper.stdin.write(json.dumps(request).encode() + b"\n")
    helper.stdin.flush()
    assert helper.stdout.readline() == b"up\n"
    return helper


def _program(helper: subprocess.Popen) -> psutil.Process:
    (child,) = psutil.Process(helper.pid).children()
    return child


def _ended(helper: subprocess.Popen) -> None:
    helper.stdin.close()  # EOF: the helper kills the task at once
    helper.wait(timeout=30)


@pytest.mark.quick
@pytest.mark.skipif(not os.path.exists(SYSTEM_PYTHON), reason=f"no {SYSTEM_PYTHON}")
def test_where_py_spy_cannot_read_it_the_helper_asks_the_program_itself_and_only_it(
    tmp: Path,
) -> None:
    run_dir, run_id = tmp / "run", f"r-{os.getpid()}"
    (tmp / "task.py").write_text(WAITER)
    env = _task_env(run_dir, run_id)
    task = _start_task(tmp, [sys.executable, bootstrap.__file__, str(tmp / "task.py")], env)
    try:
        program = _program(task)
        done = subprocess.run(
            HELPER_BY_PATH,
            input=_query(run_id, "worker-1"),
            capture_output=True,
            env={"PATH": "/usr/bin:/bin"},
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        out = done.stdout.decode()
        assert out.startswith(
            "faulthandler dump (py-spy could not read the task: py-spy is not installed"
        )
        found = stacks.where(stacks.parse(out))
        assert found is not None and found.line() == "in its own code at wait_here (task.py:6)"
        # The dump came from the program's own handler; the program and its helper run on.
        assert "wait_here" in (run_dir / "stacks" / "signal-attempt-0" / "worker-1.txt").read_text()
        assert program.is_running() and program.status() != psutil.STATUS_ZOMBIE
        assert task.poll() is None
    finally:
        _ended(task)


@pytest.mark.quick
@pytest.mark.skipif(not os.path.exists(SYSTEM_PYTHON), reason=f"no {SYSTEM_PYTHON}")
def test_a_program_without_its_faulthandler_is_never_signalled_and_the_reason_is_one_line(
    tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Not started through the bootstrap: no handler, and SIGUSR2 would end it.
    run_id = f"r-{os.getpid()}"
    (tmp / "task.py").write_text(WAITER)
    task = _start_task(tmp, [sys.executable, str(tmp / "task.py")], _task_env(tmp / "run", run_id))
    try:
        program = _program(task)
        source = stacks.helper(HELPER_BY_PATH, run_id, "worker-1", False, "on this host")
        monkeypatch.setenv("PATH", "/usr/bin:/bin")
        with pytest.raises(stacks.StackError) as raised:
            source()
        assert str(raised.value) == (
            "on this host: py-spy is not installed on this host (pip install py-spy); "
            "and the task has no faulthandler to ask"
        )
        assert program.is_running() and program.status() != psutil.STATUS_ZOMBIE
        assert task.poll() is None
        # No process of another task is taken for this one.
        other = stacks.helper(HELPER_BY_PATH, run_id, "worker-0", False, "on this host")
        with pytest.raises(stacks.StackError, match="no process of task worker-0"):
            other()
    finally:
        _ended(task)


# ---- the watchdog and `distlaunch stacks` on SSH hosts and a Slurm cluster -------------------------


def _hang_spec(folder: Path, **fields: object) -> Path:
    (folder / "task.py").write_text(CHATTY_HANG)
    spec = {
        "name": "hang",
        "strategy": "multi_worker_mirrored",
        "program": {"script": "task.py", "python": sys.executable},
        "shared_dir": "runs",
        "restart": {"policy": "never"},
        **fields,
    }
    path = folder / "spec.json"
    path.write_text(json.dumps(spec, indent=2))
    return path


def _log(run_dir: Path, task: str) -> str:
    path = run_dir / "logs" / "attempt-0" / f"{task}.log"
    return path.read_text() if path.exists() else ""


def _assert_worker_1_was_named_hung_and_nobody_was_signalled(run_dir: Path, out: str) -> None:
    """The run failed naming worker-1, stuck in its own code, from stacks read where each task
    ran; no task ended but the hung one (the launcher stopped the others at the end), and no
    program got the faulthandler's signal (py-spy read every one of them)."""
    assert f"run {run_dir.name} failed: worker-1 hung: no log output" in out
    assert f"| hung: worker-1: in its own code at {HANG_LINE}" in out
    assert "| worker-0: waits in " in out
    assert "| evaluator-0: in its own code at <module> (task.py:17)" in out  # not called hung
    assert "SIGUSR2" not in out and "no stacks" not in out
    seen = events(run_dir)
    assert [e["task"] for e in seen if e["event"] == "hung"] == ["worker-1"]
    assert not [e for e in seen if e["event"] == "exited"], "a task ended on its own"
    folder = next(p for p in (run_dir / "stacks").iterdir() if not p.name.startswith("signal-"))
    assert HANG_LINE in (folder / "worker-1.txt").read_text()
    assert "quick_execute" in (folder / "worker-0.txt").read_text()
    signalled = run_dir / "stacks" / "signal-attempt-0"
    assert [p.read_text() for p in signalled.iterdir()] == ["", "", ""]


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_a_silent_worker_on_an_ssh_host_is_named_from_its_own_frame_and_no_task_is_signalled(
    ssh_lab, tmp: Path
) -> None:
    hosts = {h.name: ssh_lab.host_entry(h) for h in ssh_lab.hosts}
    tasks = {
        "worker": [{"host": "node1"}, {"host": "node2"}],
        "evaluator": [{"host": "node1"}],
    }
    timeouts = {"grace_s": 2, "startup_s": 120, "silence_s": 8}
    spec = _hang_spec(tmp, hosts=hosts, tasks=tasks, timeouts=timeouts)
    done = subprocess.run(
        [sys.executable, "-m", "distlaunch.launcher", "up", str(spec)],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=360,
    )
    out = done.stdout + done.stderr
    print(out[-6000:])
    assert done.returncode == 1
    (run_dir,) = [p.parent for p in (tmp / "runs").glob("*/run.json")]
    assert "worker 1 stops inside step 3" in _log(run_dir, "worker-1")
    _assert_worker_1_was_named_hung_and_nobody_was_signalled(run_dir, out)


@pytest.mark.integration
@pytest.mark.timeout(500)
def test_on_slurm_stacks_leave_the_run_running_and_the_watchdog_names_the_hung_worker(
    slurm_lab, tmp: Path
) -> None:
    from test_slurm import _allocation

    tasks = {"worker": {"count": 2}, "evaluator": {"count": 1}}
    # Long enough for `distlaunch stacks` to be done before the watchdog looks.
    timeouts = {"grace_s": 2, "startup_s": 120, "silence_s": 45}
    spec = _hang_spec(tmp, backend="slurm", tasks=tasks, timeouts=timeouts)
    launcher_argv = [sys.executable, "-m", "distlaunch.launcher"]
    with _allocation(slurm_lab, tmp, "--nodes=2", "--ntasks-per-node=2") as env:
        with open(tmp / "out.txt", "w") as out:
            launcher = subprocess.Popen(
                slurm_lab.command([*launcher_argv, "up", str(spec)]),
                cwd=tmp,
                env=env,
                stdout=out,
                stderr=out,
            )
        try:
            run_dir = wait_for_run_dir(tmp / "runs", launcher)
            wait_for(
                lambda: "stops inside step" in _log(run_dir, "worker-1"),
                "worker-1 to stop",
                launcher=launcher,
            )
            shown = slurm_lab.run(
                [*launcher_argv, "stacks", run_dir.name, "--no-native"], cwd=tmp, env=env
            )
            print(shown.stdout, shown.stderr)
            assert shown.returncode == 0, shown.stderr
            # Read on the nodes, each task's own program.
            assert f"worker-1: in its own code at {HANG_LINE}" in shown.stdout
            assert "worker-0: waits in " in shown.stdout
            assert "evaluator-0: in its own code at <module> (task.py:17)" in shown.stdout
            # ... and the run goes on: no task ended, every one still running.
            assert not [e for e in events(run_dir) if e["event"] in ("exited", "hung")]
            states = {n: t["state"] for n, t in run_record(run_dir)["tasks"].items()}
            # (an evaluator runs no server: it stays "starting")
            assert states == {
                "worker-0": "running",
                "worker-1": "running",
                "evaluator-0": "starting",
            }
            assert launcher.poll() is None
            launcher.wait(timeout=300)
        finally:
            if launcher.poll() is None:
                launcher.send_signal(signal.SIGTERM)
                launcher.wait(timeout=60)
    out = (tmp / "out.txt").read_text()
    print(out[-6000:])
    assert launcher.returncode == 1
    _assert_worker_1_was_named_hung_and_nobody_was_signalled(run_dir, out)


# ---- `distlaunch stacks` on a compose run ----------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(1500)  # a cold machine builds the images first (see tests/test_compose.py)
def test_stacks_of_a_compose_run_are_read_in_the_containers_and_the_run_goes_on(
    image,  # noqa: F811 (the fixture)
    tmp: Path,
) -> None:
    tasks = {"worker": {"count": 2}, "evaluator": {"count": 1}}
    spec = _hang_spec(tmp, tasks=tasks, timeouts={"grace_s": 2, "startup_s": 120})
    launcher = _start_up(tmp, spec)
    try:
        run_dir = wait_for_run_dir(tmp / "runs", launcher)
        wait_for(
            lambda: "stops inside step" in _log(run_dir, "worker-1"),
            "worker-1 to stop",
            launcher=launcher,
        )
        shown = subprocess.run(
            [sys.executable, "-m", "distlaunch.launcher", "stacks", run_dir.name, "--no-native"],
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=600,
            env=_env(),
        )
        print(shown.stdout, shown.stderr)
        assert shown.returncode == 0, shown.stderr
        # Read in each container, of its program: by py-spy, or where it lacks the rights there,
        # by the program's own faulthandler (the capture says which, and why, in its first line).
        assert f"worker-1: in its own code at {HANG_LINE}" in shown.stdout
        assert "worker-0: waits in " in shown.stdout
        assert "evaluator-0: in its own code at <module> (task.py:17)" in shown.stdout
        # A program got the faulthandler's signal only where py-spy could not read it.
        folder = next(p for p in (run_dir / "stacks").iterdir() if not p.name.startswith("signal-"))
        for name in ("worker-0", "worker-1", "evaluator-0"):
            captured = (folder / f"{name}.txt").read_text()
            print(name, captured.splitlines()[0])
            asked = captured.startswith("faulthandler dump (py-spy could not read the task: ")
            signalled = run_dir / "stacks" / "signal-attempt-0" / f"{name}.txt"
            assert bool(signalled.read_text()) == asked
        # ... and the run goes on.
        assert not [e for e in events(run_dir) if e["event"] in ("exited", "hung")]
        states = {n: t["state"] for n, t in run_record(run_dir)["tasks"].items()}
        assert states == {"worker-0": "running", "worker-1": "running", "evaluator-0": "starting"}
        assert launcher.poll() is None
        project = run_record(run_dir)["compose"]["project"]
        down = subprocess.run(
            [sys.executable, "-m", "distlaunch.launcher", "down", run_dir.name],
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert down.returncode == 0, down.stderr
        launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.communicate()
    assert _leftovers(project) == ([], [])
