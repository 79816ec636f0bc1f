"""`distlaunch up` end to end with real 2-process MWMS clusters on localhost ports (a stand-in where
only the launcher's own teardown is tested)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import pytest
import standins

from conftest import (
    all_running,
    distlaunch,
    events,
    example,
    only_run_dir,
    processes_of_run,
    run_record,
    wait_for,
    wait_for_run_dir,
    write_spec,
)

pytestmark = pytest.mark.integration

# A worker that dies on purpose once the cluster formed (a stand-in: no TensorFlow, what is tested
# is the launcher's stop of the others and its headline): worker-1 raises once worker-0 serves;
# worker-0, as an MWMS worker blocked in a collective does, ignores SIGTERM and must be stopped
# by the launcher (its KILL after grace_s).
FAILING = (
    standins.SWALLOW_SIGTERM
    + standins.listening(standins.ANY)
    + """
if cfg["task"]["index"] == 1:
    peer = cfg["cluster"]["worker"][0].rsplit(":", 1)
    while True:
        try:
            socket.create_connection((peer[0], int(peer[1])), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("worker one gives up")
time.sleep(3600)
"""
)


def _final_losses(run_dir: Path, attempt: int = 0) -> list[str]:
    logs = sorted((run_dir / "logs" / f"attempt-{attempt}").glob("worker-*.log"))
    return [re.findall(r"final loss (\S+)", log.read_text())[-1] for log in logs]


def test_two_workers_train_to_completion(tmp):
    spec = write_spec(tmp, program=example("mnist_mlp", 2, 10))
    result = distlaunch("up", str(spec), cwd=tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = only_run_dir(tmp / "runs")
    # Live output is prefixed per task.
    assert re.search(r"^worker-0 \| final loss ", result.stdout, re.M)
    assert re.search(r"^worker-1 \| final loss ", result.stdout, re.M)
    losses = _final_losses(run_dir)
    assert len(losses) == 2 and losses[0] == losses[1]
    record = run_record(run_dir)
    assert record["state"] == "succeeded" and record["exit_code"] == 0
    assert {t["exit_code"] for t in record["tasks"].values()} == {0}
    assert all(
        t["state"] == "succeeded" and t["pid"] > 0 and t["port"] > 0
        for t in record["tasks"].values()
    )
    assert record["plan"]["tasks"][0]["tf_config"]["cluster"]["worker"][0].startswith("127.0.0.1:")
    assert (run_dir / "checkpoints" / "checkpoint").is_file()
    metrics = json.loads((run_dir / "metrics" / "worker-0.json").read_text())
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert [e["event"] for e in events(run_dir)].count("joined") == 2
    assert not processes_of_run(record["run_id"])


def test_a_failing_task_stops_the_others_and_is_named(tmp):
    (tmp / "task.py").write_text(FAILING)
    spec = write_spec(tmp)
    result = distlaunch("up", str(spec), cwd=tmp)
    assert result.returncode == 1, result.stderr[-3000:]
    run_dir = only_run_dir(tmp / "runs")
    record = run_record(run_dir)
    headline = [line for line in result.stderr.splitlines() if " failed: " in line]
    assert headline == [
        f"distlaunch: run {record['run_id']} failed: worker-1 exit code 1 after {headline[0].split(' after ')[1]}"
    ]
    assert "RuntimeError: worker one gives up" in headline[0]
    assert "Traceback" in result.stderr  # the evidence under the headline
    assert record["state"] == "failed" and record["failure"]["task"] == "worker-1"
    assert record["tasks"]["worker-0"]["state"] == "stopped"
    # Typed (version 2): what ended it, not only the words.
    assert record["version"] == 2
    assert (record["failure"]["kind"], record["failure"]["exit_code"]) == ("exited", 1)
    assert not processes_of_run(record["run_id"])


def _running_run(tmp: Path, launcher: subprocess.Popen) -> Path:
    run_dir = wait_for_run_dir(tmp / "runs", launcher)
    wait_for(lambda: all_running(run_dir, 2), "both workers to join", launcher=launcher)
    return run_dir


def test_ctrl_c_tears_down_then_resume_continues_from_the_checkpoint(tmp, launch):
    spec = write_spec(
        tmp,
        program=example("mnist_mlp", 8, 25, "--checkpoint-every", "5"),
    )
    launcher = launch(spec)
    run_dir = _running_run(tmp, launcher)
    wait_for(lambda: (run_dir / "checkpoints" / "checkpoint").is_file(), "a first checkpoint")
    launcher.send_signal(signal.SIGINT)
    launcher.wait(timeout=120)
    err = (tmp / "stderr.txt").read_text()
    assert launcher.returncode == 130, err[-3000:]
    assert "interrupted by SIGINT" in err
    record = run_record(run_dir)
    assert record["state"] == "interrupted"
    assert not processes_of_run(record["run_id"])

    resumed = distlaunch("up", "--resume", str(spec), cwd=tmp)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming run {record['run_id']} (attempt 1)" in resumed.stderr
    steps = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", resumed.stdout)]
    assert len(steps) == 2 and steps[0] == steps[1] > 0
    metrics = json.loads((run_dir / "metrics" / "worker-0.json").read_text())
    assert metrics[-1]["step"] == 8 * 25
    assert len(set(_final_losses(run_dir, attempt=1))) == 1


# A stand-in task (no TensorFlow: what dies with the launcher is the launcher's business): it
# serves on its task port as a TensorFlow server does and, as TensorFlow's handler does, swallows
# SIGTERM, so only the launcher's own teardown (a kill) can end it.
SWALLOWS_SIGTERM = standins.listen_and_sleep(3600, standins.ANY, swallow_sigterm=True)


@pytest.mark.quick
def test_killing_the_launcher_leaves_no_task_behind(tmp, launch):
    (tmp / "task.py").write_text(SWALLOWS_SIGTERM)
    spec = write_spec(tmp)
    launcher = launch(spec)
    run_dir = _running_run(tmp, launcher)
    pids = [t["pid"] for t in run_record(run_dir)["tasks"].values()]
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(timeout=30)
    run_id = run_dir.name
    wait_for(
        lambda: not processes_of_run(run_id), "the tasks to die with their launcher", limit_s=30
    )
    assert pids and not processes_of_run(run_id)
