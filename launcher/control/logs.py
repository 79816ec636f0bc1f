"""`distlaunch logs`: the tail of each task's log in its latest attempt, and following them."""

from __future__ import annotations

import time
from pathlib import Path

from distlaunch.launcher.control.liveness import launcher_alive
from distlaunch.launcher.core.console import Console, LogFollower
from distlaunch.launcher.core.errors import UsageError
from distlaunch.launcher.record.state import RunRecord

FOLLOW_INTERVAL_S = 0.2


def log_files(run_dir: Path, task: str | None) -> list[Path]:
    """The log file of every task (or of ``task``) in its latest attempt."""
    record = RunRecord.load(run_dir)
    files = []
    for name, entry in record.tasks.items():
        if task is None or name == task.replace(":", "-"):
            files.append(run_dir / "logs" / f"attempt-{entry.attempt}" / f"{name}.log")
    if task is not None and not files:
        raise UsageError(f"run {record.run_id} has no task {task!r}")
    return files


def follow(run_dir: Path, task: str | None, console: Console) -> None:
    """Echo new log lines as they come, across restarts (new attempts), until the run ends.

    Files present at the start are followed from their end (`logs` printed their tail already);
    a file that appears later, a restarted task's new attempt, is followed from its beginning.
    """
    followers: dict[Path, LogFollower] = {}
    first = True
    while True:
        finished = not launcher_alive(RunRecord.load(run_dir))
        files = log_files(run_dir, task)
        width = max((len(f.stem) for f in files), default=0)
        for number, path in enumerate(files):
            if path not in followers:
                followers[path] = LogFollower(
                    str(path), console.prefix(path.stem, number, width), console
                )
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
