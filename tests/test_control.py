"""Inspecting and controlling a live run from another shell: status, logs, restart, down.

The tasks are stand-ins (no TensorFlow): what is tested is the launcher's side of each command.
They serve their TF_CONFIG port as TensorFlow's server does (the launcher sees them join), print
a line every 0.1 s, and save on a stop notice as dw.fit does: exit 75 (EXIT_PREEMPTED)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import standins

from conftest import (
    all_running,
    distlaunch,
    events,
    processes_of_run,
    run_record,
    wait_for,
    wait_for_run_dir,
    write_spec,
)
from distlaunch.worker import contract

pytestmark = pytest.mark.integration

# A gang restart binds the ports again while the last attempt's are in TIME_WAIT.
STEPS_AND_SAVES = (
    standins.listening(standins.ANY, bind_tries=100)
    + """
import signal

PreemptionCheckpointHandler = None  # what program_scan looks for: this program saves on a notice


def save(signum, frame):
    print("saved", flush=True)
    os._exit(75)  # saved on the notice and stopped (worker/contract.py EXIT_PREEMPTED)


signal.signal(signal.SIGTERM, save)
step = 0
while True:
    print("step", step, flush=True)
    step += 1
    time.sleep(0.1)
"""
)


def test_status_logs_restart_down_from_another_shell(tmp, launch):
    (tmp / "task.py").write_text(STEPS_AND_SAVES)
    spec = write_spec(tmp)
    launcher = launch(spec)
    run_dir = wait_for_run_dir(tmp / "runs", launcher)
    run_id = run_dir.name
    wait_for(lambda: all_running(run_dir, 2), "both joined")

    status = distlaunch("status", run_id, "--json", cwd=tmp)  # by id, under ./runs
    assert status.returncode == 0, status.stderr
    table = json.loads(status.stdout)
    assert table["state"] == "running"
    assert [(r["task"], r["state"], r["attempt"], r["restarts"]) for r in table["tasks"]] == [
        ("worker-0", "running", 0, 0),
        ("worker-1", "running", 0, 0),
    ]
    assert all(r["pid"] > 0 and r["uptime_s"] >= 0 for r in table["tasks"])
    text = distlaunch("status", str(run_dir), cwd=tmp)
    assert "worker-1" in text.stdout and "RESTARTS" in text.stdout

    follower = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "distlaunch.launcher",
            "logs",
            str(run_dir),
            "worker-1",
            "-f",
            "-n",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # A manual restart of one MWMS worker restarts the gang, outside the (never) policy's budget.
        restarted = distlaunch("restart", str(run_dir), "worker:1")
        assert restarted.returncode == 0, restarted.stderr
        wait_for(
            lambda: all(
                t.get("state") == "running" and t.get("attempt") == 1
                for t in run_record(run_dir)["tasks"].values()
            ),
            "the gang back",
        )
        assert {t["restarts"] for t in run_record(run_dir)["tasks"].values()} == {1}
        assert [e["task"] for e in events(run_dir) if e["event"] == "restart-requested"] == [
            "worker-1"
        ]
        new_log = run_dir / "logs" / "attempt-1" / "worker-0.log"
        # Joined means its server listens; its first line may come a moment later.
        wait_for(lambda: new_log.exists() and new_log.stat().st_size > 0, "worker-0's new log")

        logs = distlaunch("logs", str(run_dir), "worker-0", "-n", "3")
        assert logs.returncode == 0 and logs.stdout.startswith("worker-0 | ")
        assert distlaunch("restart", str(run_dir), "worker:7").returncode == 2

        down = distlaunch("down", str(run_dir))
        assert down.returncode == 0, down.stderr
        launcher.wait(timeout=60)
        follower_out, _ = follower.communicate(timeout=60)  # -f ends with the run
    finally:
        follower.kill()
    # down's stop notice: the workers saved and stopped, as dw.fit's do (tests/test_preemption.py).
    assert launcher.returncode == contract.EXIT_PREEMPTED
    assert run_record(run_dir)["state"] == "preempted"
    assert "worker-1 | " in follower_out  # the restarted task's new attempt was followed
    assert not processes_of_run(run_id)
    not_running = distlaunch("restart", str(run_dir), "worker:1")
    assert not_running.returncode == 2 and "is not running" in not_running.stderr
