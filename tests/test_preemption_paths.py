"""Every way a stop notice can meet a run (issue 36), with a tiny stand-in program, no TensorFlow.

The stand-in behaves as a task of `dw.fit` does where it matters to the launcher: it imports
distlaunch.worker (so the launcher knows it can save on a notice), "imports TensorFlow" for
``start_s`` seconds with SIGTERM at its default action (a notice then would kill it), serves on
its port, reports "ready" with its step, and on the notice "saves" for ``save_s`` seconds,
reports "preempted" with the saved step and exits with ``exit``. Each test runs the real launcher
and checks how `up` (and `down`) end: a second `down` joins the save, a third signal stops at
once, a mix of exits after a notice ends, a notice during the start is held, one after training
is done ends succeeded, a late save counts and a cut save's folder goes. The pure decisions are
in tests/test_policy.py; real TensorFlow runs of the same paths are bench/preemption.py's
``--double`` and ``--early``, and tests/test_preemption.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import standins

from conftest import distlaunch, events, processes_of_run, run_record, wait_for, write_spec
from distlaunch.worker import contract

STAND_IN = (
    """
import json, os, signal, sys, time
import distlaunch.worker as dw
from distlaunch.worker import contract, runtime

ctx = dw.context()
plan = json.loads(sys.argv[1])
me = {**plan.get("*", {}), **plan.get(ctx.name, {})}
run_dir = os.environ["DISTLAUNCH_RUN_DIR"]
if "index" in me:  # a checkpoint index, as an earlier attempt left it
    os.makedirs(os.path.join(run_dir, "checkpoints"), exist_ok=True)
    with open(os.path.join(run_dir, "checkpoints", "checkpoint"), "w") as f:
        f.write(f'model_checkpoint_path: "ckpt-{me["index"]}"\\n')
if "cut" in me:  # what a save cut short leaves
    os.makedirs(os.path.join(run_dir, "checkpoints", f"ckpt-{me['cut']}_temp"), exist_ok=True)
time.sleep(me.get("start_s", 0))  # importing TensorFlow: a SIGTERM now kills
if ctx.role != "evaluator":  # not in TF_CONFIG's cluster: it serves nothing
"""
    + standins.indented(standins.listening(standins.ANY))
    + """
if "finish" in me:  # training is over for this task
    if me.get("done"):
        runtime.write_json_atomic(
            contract.training_done_path(ctx.run_dir), {"attempt": ctx.attempt, "step": 7}
        )
    if me["finish"] == "exit":
        sys.exit(0)
noticed = []
signal.signal(signal.SIGTERM, lambda signum, frame: noticed.append(time.monotonic()))
runtime.report(contract.STATE_READY, step=7)
print("ready", flush=True)
while not noticed:
    time.sleep(0.05)
print("noticed", flush=True)
time.sleep(me.get("save_s", 0))
runtime.report(contract.STATE_PREEMPTED, saved_step=7, save_s=me.get("save_s", 0))
print("stop notice: saved step 7", flush=True)
os._exit(me.get("exit", contract.EXIT_PREEMPTED))
"""
)


def _up(launch, tmp: Path, plan: dict, **timeouts: float) -> tuple[subprocess.Popen, Path]:
    """Start `up` (the `launch` fixture: killed and reaped whatever the test does) on the stand-in with ``plan`` (task name or "*" -> behaviour); wait for its
    run dir."""
    (tmp / "task.py").write_text(STAND_IN)
    tasks = {"worker": {"count": 2}}
    if any(name.startswith("evaluator") for name in plan):
        tasks["evaluator"] = {"count": 1}
    spec = write_spec(
        tmp,
        program={"script": "task.py", "args": [json.dumps(plan)]},
        tasks=tasks,
        timeouts={"grace_s": 2, "startup_s": 120, "save_s": 30, **timeouts},
    )
    launcher = launch(spec)
    run_json = wait_for(
        lambda: next((tmp / "runs").glob("*/run.json"), None) if (tmp / "runs").exists() else None,
        "the run dir",
        launcher=launcher,
    )
    return launcher, run_json.parent


def _printed(run_dir: Path, text: str, tasks: tuple[str, ...] = ("worker-0", "worker-1")) -> bool:
    logs = run_dir / "logs" / "attempt-0"
    return all(
        (logs / f"{t}.log").exists() and text in (logs / f"{t}.log").read_text() for t in tasks
    )


def _end(launcher: subprocess.Popen, tmp: Path, timeout: float = 90) -> str:
    """Wait for `up` to end (killed, and the test failed, if it does not); return its stderr."""
    try:
        launcher.wait(timeout=timeout)
    finally:
        launcher.kill()
    return (tmp / "stderr.txt").read_text()


def test_a_second_down_joins_the_save_and_both_say_how_the_run_ended(tmp, launch):
    launcher, run_dir = _up(launch, tmp, {"*": {"save_s": 4}})
    try:
        wait_for(lambda: _printed(run_dir, "ready"), "both tasks to be ready")
        shared = str(tmp / "runs")
        first = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distlaunch.launcher",
                "down",
                run_dir.name,
                "--shared-dir",
                shared,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_for(lambda: _printed(run_dir, "noticed"), "the first down's notice")
        second = distlaunch("down", run_dir.name, "--shared-dir", shared)
        out, err = first.communicate(timeout=90)
    finally:
        err_up = _end(launcher, tmp)
    assert launcher.returncode == contract.EXIT_PREEMPTED, err_up[-3000:]
    assert first.returncode == 0 and second.returncode == 0, (err, second.stderr)
    assert f"run {run_dir.name}: saving step 7, started " in second.stdout
    assert f"`distlaunch down --now {run_dir.name}` stops without saving" in second.stdout
    for said in (out, second.stdout):
        assert "its tasks saved step 7; `up --resume` continues" in said
    assert "stop notice again (SIGTERM): saving step 7, started " in err_up
    # A `down` that comes once the run has ended still says where it saved.
    late = distlaunch("down", run_dir.name, "--shared-dir", shared)
    assert late.stdout == (
        f"run {run_dir.name}: nothing was left running; it had ended: its tasks saved step 7; "
        "`up --resume` continues\n"
    )
    record = run_record(run_dir)
    assert record["state"] == "preempted" and record["preempted"]["step"] == 7
    notices = [e for e in events(run_dir) if e["event"] == "notice"]
    assert [e.get("joined", False) for e in notices] == [False, True]
    assert not processes_of_run(record["run_id"])


def test_a_third_stop_signal_stops_at_once_and_down_says_why_nothing_was_saved(tmp, launch):
    launcher, run_dir = _up(launch, tmp, {"*": {"save_s": 600}})
    try:
        wait_for(lambda: _printed(run_dir, "ready"), "both tasks to be ready")
        launcher.send_signal(signal.SIGTERM)
        wait_for(lambda: _printed(run_dir, "noticed"), "the notice")
        launcher.send_signal(signal.SIGTERM)
        wait_for(lambda: "stop notice again" in (tmp / "stderr.txt").read_text(), "the join")
        launcher.send_signal(signal.SIGTERM)
    finally:
        err = _end(launcher, tmp)
    assert launcher.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "a third stop signal (SIGTERM) during the save: stopping at once" in err
    record = run_record(run_dir)
    assert record["state"] == "interrupted"
    assert record["notice"]["stopped"].startswith("a third stop signal")
    assert not processes_of_run(record["run_id"])


@pytest.mark.quick
def test_a_notice_ends_when_one_task_finished_and_the_other_saved(tmp, launch):
    # worker-0's own handler exits 0 (it was in its last step), worker-1's exits 143 (saved):
    # before, each waited for the other to be like itself, forever.
    launcher, run_dir = _up(launch, tmp, {"worker-0": {"exit": 0}, "worker-1": {"exit": 143}})
    try:
        wait_for(lambda: _printed(run_dir, "ready"), "both tasks to be ready")
        launcher.send_signal(signal.SIGTERM)
    finally:
        err = _end(launcher, tmp)
    assert launcher.returncode == contract.EXIT_PREEMPTED, err[-3000:]
    record = run_record(run_dir)
    assert record["state"] == "preempted"
    assert {n: t["exit_code"] for n, t in record["tasks"].items()} == {
        "worker-0": 0,
        "worker-1": 143,
    }
    last = [e for e in events(run_dir) if e["event"] == "exited"][-1]
    assert last["decision"] == "preempted" and "worker-0 finished" in last["reason"]


def test_a_notice_while_tasks_start_is_held_until_they_can_take_it(tmp, launch):
    # 4 s of "importing TensorFlow" with SIGTERM at its default action: the notice waits.
    launcher, run_dir = _up(launch, tmp, {"*": {"start_s": 4}})
    try:
        wait_for(
            lambda: len([e for e in events(run_dir) if e["event"] == "started"]) == 2,
            "both tasks to start",
        )
        launcher.send_signal(signal.SIGTERM)
    finally:
        err = _end(launcher, tmp)
    assert launcher.returncode == contract.EXIT_PREEMPTED, err[-3000:]
    assert "worker-0, worker-1 still starting: its notice waits until it can take it" in err
    record = run_record(run_dir)
    assert record["state"] == "preempted" and record["preempted"]["step"] == 7
    assert _printed(run_dir, "stop notice: saved step 7")


def test_a_notice_held_past_save_s_ends_preempted_where_the_attempt_resumed(tmp, launch):
    # The tasks never get far enough to take the notice within save_s: nothing of this attempt
    # was trained, so it ends preempted at the checkpoint it started from (ckpt-40).
    launcher, run_dir = _up(
        launch, tmp, {"*": {"start_s": 600}, "worker-0": {"index": 40}}, save_s=1
    )
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "checkpoint").exists(), "the index")
        launcher.send_signal(signal.SIGTERM)
    finally:
        err = _end(launcher, tmp)
    assert launcher.returncode == contract.EXIT_PREEMPTED, err[-3000:]
    assert "nothing was trained in this attempt, so nothing is lost" in err
    assert run_record(run_dir)["preempted"]["step"] == 40
    assert "preempted at step 40; `distlaunch up " in err


@pytest.mark.quick
def test_a_notice_after_training_finished_ends_succeeded(tmp, launch):
    # worker-1 finished; the chief wrote the "training done" marker and is still finishing up.
    plan = {"worker-0": {"finish": "linger", "done": True}, "worker-1": {"finish": "exit"}}
    launcher, run_dir = _up(launch, tmp, plan)
    try:
        wait_for(lambda: (run_dir / "training_done.json").exists(), "training to be done")
        wait_for(lambda: run_record(run_dir)["tasks"]["worker-1"]["exit_code"] == 0, "worker-1")
        launcher.send_signal(signal.SIGTERM)
    finally:
        err = _end(launcher, tmp)
    assert launcher.returncode == 0, err[-3000:]
    assert "stop notice: training was done when the notice came: the run succeeded" in err
    record = run_record(run_dir)
    assert record["state"] == "succeeded" and record["exit_code"] == 0
    assert record["notice"]["done"] == "training was done when the notice came"


@pytest.mark.quick
def test_a_notice_during_the_evaluators_drain_ends_succeeded_and_says_it_was_cut(tmp, launch):
    plan = {
        "worker-0": {"finish": "exit", "done": True},
        "worker-1": {"finish": "exit"},
        "evaluator-0": {},
    }
    launcher, run_dir = _up(launch, tmp, plan, evaluator_drain_s=600)
    try:
        wait_for(
            lambda: any(e.get("decision") == "done" for e in events(run_dir)),
            "training to be done (the evaluator's drain)",
        )
        launcher.send_signal(signal.SIGTERM)
    finally:
        err = _end(launcher, tmp)
    assert launcher.returncode == 0, err[-3000:]
    assert "the run succeeded; evaluator-0 cut short of its drain" in err
    assert run_record(run_dir)["state"] == "succeeded"


def test_a_save_that_ends_after_save_s_counts_and_cut_saves_are_removed(tmp, launch):
    # The save takes 3 s, save_s is 1: the grace period (10 s) lets it end, and it counts.
    launcher, run_dir = _up(
        launch, tmp, {"*": {"save_s": 3}, "worker-0": {"cut": 5}}, save_s=1, grace_s=10
    )
    try:
        wait_for(lambda: _printed(run_dir, "ready"), "both tasks to be ready")
        assert (run_dir / "checkpoints" / "ckpt-5_temp").is_dir()
        launcher.send_signal(signal.SIGTERM)
    finally:
        err = _end(launcher, tmp)
    assert launcher.returncode == contract.EXIT_PREEMPTED, err[-3000:]
    assert "did not save within 1 s of the stop notice (timeouts.save_s)" in err
    assert "the save took longer than timeouts.save_s (1 s) and ended within" in err
    record = run_record(run_dir)
    assert record["state"] == "preempted"
    assert record["preempted"] == {"step": 7, "save_s": 3, "late": True}
    assert "removed what saves cut short left: ckpt-5_temp/" in err
    assert not (run_dir / "checkpoints" / "ckpt-5_temp").exists()
