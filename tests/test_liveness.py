"""One launcher-liveness check (pid + process start time) for status, restart, down and up.

A run recorded as running whose launcher is gone (killed outright), or whose launcher's pid now
belongs to another process, must not look alive: `status` says "lost", `restart` refuses and
never signals the stranger, `up` may resume it. No launcher is started: each run.json is written
the way a dead launcher leaves it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import distlaunch

pytestmark = pytest.mark.quick


def _orphaned_run(tmp: Path, launcher_pid: int, started_at: float) -> Path:
    run_dir = tmp / "runs" / "t-1"
    run_dir.mkdir(parents=True)
    task = {"role": "worker", "index": 0, "port": 1, "state": "running", "pid": launcher_pid}
    record = {
        "run_id": "t-1",
        "name": "t",
        "state": "running",
        "attempt": 0,
        "launcher_pid": launcher_pid,
        "started_at": started_at,
        "tasks": {"worker-0": task},
    }
    (run_dir / "run.json").write_text(json.dumps(record))
    return run_dir


@pytest.fixture
def stranger():
    """A process that is not a launcher, started after the recorded run started."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_reused_pid_is_not_the_launcher(tmp: Path, stranger: subprocess.Popen) -> None:
    # Issue 14 item 13: the run started (and its launcher died) before this pid was given out.
    run_dir = _orphaned_run(tmp, stranger.pid, time.time() - 100)
    status = distlaunch("status", str(run_dir), "--json")
    assert status.returncode == 0, status.stderr
    table = json.loads(status.stdout)
    assert table["state"] == "lost" and table["tasks"][0]["uptime_s"] is None
    restart = distlaunch("restart", "t-1", "worker:0", "--shared-dir", str(tmp / "runs"))
    assert restart.returncode == 2 and "is not running (lost)" in restart.stderr
    time.sleep(0.5)  # a SIGUSR1 would have terminated it by now
    assert stranger.poll() is None


def test_a_killed_launchers_run_shows_as_lost(tmp: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    run_dir = _orphaned_run(tmp, gone.pid, time.time())
    text = distlaunch("status", str(run_dir))
    assert text.returncode == 0, text.stderr
    assert "run t-1: lost" in text.stdout and "distlaunch down t-1" in text.stdout
