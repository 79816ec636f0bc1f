"""`distlaunch status`: a run's state and one row per task, from its run.json."""

from __future__ import annotations

import time

from distlaunch.launcher.control.liveness import launcher_alive
from distlaunch.launcher.state import RunRecord

# What `status` shows for a run recorded as running whose launcher is gone (killed outright).
LOST = "lost"


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
