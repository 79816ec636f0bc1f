"""`distlaunch restart`: ask a live run's launcher to restart a task.

The request is a file in the run's control/ folder followed by a signal to the launcher
(`rundir` owns both: the supervisor takes the requests when the signal wakes it).
"""

from __future__ import annotations

from pathlib import Path

from distlaunch.launcher.control.liveness import live_launcher
from distlaunch.launcher.control.status import run_state
from distlaunch.launcher.core.errors import UsageError
from distlaunch.launcher.record import rundir
from distlaunch.launcher.record.state import RunRecord


def request_restart(run_dir: Path, task: str) -> str:
    """Ask a run's launcher to restart ``task`` (``worker-1`` or ``worker:1``); return its name.

    The launcher applies the same restart sets as for a failure (an MWMS task restarts the whole
    gang, a PSS ps restarts with the chief), without counting against the restart budget.
    """
    record = RunRecord.load(run_dir)
    name = task.replace(":", "-")
    if name not in record.tasks:
        names = ", ".join(record.tasks)
        raise UsageError(f"run {record.run_id} has no task {task!r}; expected one of: {names}")
    launcher = live_launcher(record) if record.state.live else None
    if launcher is None:
        state = run_state(record)
        raise UsageError(f"run {record.run_id} is not running ({state}); nothing to restart")
    rundir.add_restart_request(run_dir, name)
    # The process checked just now, not a bare pid: a reused pid is never signalled.
    launcher.send_signal(rundir.CONTROL_SIGNAL)
    return name
