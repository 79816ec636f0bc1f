"""`distlaunch status`: a run's state and one row per task, from its run.json; `--watch` redraws
the tasks' training progress (progress_view) every second, like top."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from distlaunch.launcher.control.liveness import launcher_alive
from distlaunch.launcher.diagnosis import progress_view
from distlaunch.launcher.record.state import RunRecord

# What `status` shows for a run recorded as running whose launcher is gone (killed outright).
LOST = "lost"
# `status --watch` redraws this often (seconds).
WATCH_INTERVAL_S = 1.0
_HOME_CLEAR = "\x1b[H\x1b[2J"


def run_state(record: RunRecord) -> str:
    """The run's state as `status` shows it: the recorded one, or LOST when the record says it
    runs but its launcher is gone."""
    if record.state.live and not launcher_alive(record):
        return LOST
    return record.state.value


def status_rows(record: RunRecord, now: float | None = None) -> list[dict]:
    """One row per task: state, pid, attempt, restarts, uptime (s, while it runs), port, exit."""
    now = time.time() if now is None else now
    live = run_state(record) != LOST and record.state.live
    rows = []
    for name, task in record.tasks.items():
        running = live and task.state is not None and task.state.live
        started = task.started_at
        rows.append(
            {
                "task": name,
                "state": task.state.value if task.state is not None else None,
                "pid": task.pid,
                "port": task.port,
                "attempt": task.attempt,
                "restarts": task.restarts,
                "uptime_s": round(now - started, 1) if running and started is not None else None,
                "exit": task.exit,
            }
        )
    return rows


def watch(run_dir: Path, write: Callable[[str], None]) -> None:
    """Redraw the progress screen of the run in ``run_dir`` every WATCH_INTERVAL_S with
    ``write`` until the run is over (its last frame stays) or Ctrl-C."""
    try:
        while True:
            record = RunRecord.load(run_dir)
            state = run_state(record)
            rows = progress_view.task_progress(run_dir, record)
            stamp = time.strftime("%H:%M:%S")
            frame = progress_view.screen(record, state, run_dir, rows)
            write(f"{_HOME_CLEAR}distlaunch status --watch  {stamp}  (Ctrl-C quits)\n")
            write("\n".join(frame) + "\n")
            if state == LOST or not record.state.live:
                return
            time.sleep(WATCH_INTERVAL_S)
    except KeyboardInterrupt:
        return
