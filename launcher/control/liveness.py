"""Whether a run's launcher is still running: the one check `status`, `restart`, `down` and `up`
share.

A pid alone is not enough: after the launcher dies (SIGKILL, a reboot) its pid can be reused by
any process, which `restart` would then send SIGUSR1 to (whose default action terminates it) and
`status` would show as a running run. The launcher is the process with the recorded pid that
was created no later than the run started (run.json's `started_at` is taken by the launcher
itself, after it started).
"""

from __future__ import annotations

import os

import psutil

from distlaunch.launcher.record.state import RunRecord

# psutil derives a process's start time from clock ticks since boot: allow for their rounding.
_CLOCK_SLACK_S = 0.05


def live_launcher(record: RunRecord) -> psutil.Process | None:
    """The run's launcher process if it still runs (and is not this process), else None."""
    pid = record.launcher_pid
    if not isinstance(pid, int) or pid <= 0 or pid == os.getpid() or not record.started_at:
        return None
    try:
        proc = psutil.Process(pid)
        if proc.create_time() > record.started_at + _CLOCK_SLACK_S:
            return None  # a newer process that got the pid
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def launcher_alive(record: RunRecord) -> bool:
    """Whether the run is live (running or stopping) and its launcher still runs."""
    return record.state.live and live_launcher(record) is not None
