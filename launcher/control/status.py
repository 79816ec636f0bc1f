"""Inspecting and steering a run from another shell: status rows, following logs, restart requests.

Everything goes through the run directory: run.json (written by the launcher on every change),
the log files, and a control/ folder where `distlaunch restart` drops a request before waking
the launcher with SIGUSR1.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from distlaunch.launcher import procs, rundir
from distlaunch.launcher.console import Console, LogFollower
from distlaunch.launcher.errors import UsageError

FOLLOW_INTERVAL_S = 0.2


def status_rows(record: dict, now: float | None = None) -> list[dict]:
    """One row per task: state, pid, attempt, restarts, uptime (s, while it runs), port, exit."""
    now = time.time() if now is None else now
    rows = []
    for name, task in (record.get("tasks") or {}).items():
        running = task.get("state") in ("starting", "running") and record.get("state") in (rundir.RUNNING, rundir.STOPPING)
        started = task.get("started_at")
        rows.append({
            "task": name,
            "state": task.get("state"),
            "pid": task.get("pid"),
            "port": task.get("port"),
            "attempt": task.get("attempt", 0),
            "restarts": task.get("restarts", 0),
            "uptime_s": round(now - started, 1) if running and isinstance(started, (int, float)) else None,
            "exit": task.get("exit"),
        })
    return rows


def launcher_alive(record: dict) -> bool:
    """Whether the run's launcher process still runs (so the run can be steered)."""
    return record.get("state") in (rundir.RUNNING, rundir.STOPPING) and procs.pid_alive(record.get("launcher_pid"))


def request_restart(run_dir: Path, task: str) -> str:
    """Ask a run's launcher to restart ``task`` (``worker-1`` or ``worker:1``); return its name.

    The launcher applies the same restart sets as for a failure (an MWMS task restarts the whole
    gang, a PSS ps restarts with the chief), without counting against the restart budget.
    """
    record = _record(run_dir)
    name = task.replace(":", "-")
    if name not in (record.get("tasks") or {}):
        names = ", ".join(record.get("tasks") or {})
        raise UsageError(f"run {record.get('run_id')} has no task {task!r}; expected one of: {names}")
    if not launcher_alive(record):
        raise UsageError(f"run {record.get('run_id')} is not running ({record.get('state')}); nothing to restart")
    control = run_dir / "control"
    control.mkdir(mode=0o700, exist_ok=True)
    rundir.create_file(control / f"restart-{name}")
    os.kill(record["launcher_pid"], signal.SIGUSR1)
    return name


def log_files(run_dir: Path, task: str | None) -> list[Path]:
    """The log file of every task (or of ``task``) in its latest attempt."""
    record = _record(run_dir)
    files = []
    for name, entry in (record.get("tasks") or {}).items():
        if task is None or name == task.replace(":", "-"):
            files.append(run_dir / "logs" / f"attempt-{entry.get('attempt', 0)}" / f"{name}.log")
    if task is not None and not files:
        raise UsageError(f"run {record.get('run_id')} has no task {task!r}")
    return files


def follow(run_dir: Path, task: str | None, console: Console) -> None:
    """Echo new log lines as they come, across restarts (new attempts), until the run ends.

    Files present at the start are followed from their end (`logs` printed their tail already);
    a file that appears later, a restarted task's new attempt, is followed from its beginning.
    """
    followers: dict[Path, LogFollower] = {}
    first = True
    while True:
        finished = not launcher_alive(_record(run_dir))
        files = log_files(run_dir, task)
        width = max((len(f.stem) for f in files), default=0)
        for number, path in enumerate(files):
            if path not in followers:
                followers[path] = LogFollower(str(path), console.prefix(path.stem, number, width), console)
                if first:
                    followers[path].skip_to_end()
            followers[path].pump()
        console.out.flush()
        first = False
        if finished:
            for follower in followers.values():
                follower.close()
            return
        time.sleep(FOLLOW_INTERVAL_S)


def _record(run_dir: Path) -> dict:
    record = rundir.read_json(run_dir / rundir.RUN_JSON)
    if not isinstance(record, dict):
        raise UsageError(f"{run_dir / rundir.RUN_JSON} is not a run record")
    return record
