"""The remote helper as the launcher sees it: a task on another machine runs under
`distlaunch.host.remote`, its keeper there (started by the machine's agent: see
launcher/transports/agent.py; or directly, by `docker exec` or a stacks query).

What the launcher says to a helper and reads back is here:
- the task's argv, environment and working dir reach the helper as one JSON request
  (`request_of`): no spec value is ever parsed by a shell;
- the helper relays the task's exit code, 128+N for signal N (neither SSH nor srun carries a
  signal death), with its last line in the task's log saying so (`log_ends_with_death`).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from distlaunch.host import remote
from distlaunch.host.timeouts import HEARTBEAT_TIMEOUT_S
from distlaunch.launcher.plan.plan import TaskPlan
from distlaunch.worker import contract

HELPER_MODULE = "distlaunch.host.remote"
# After `stop`, the helper takes grace_s to end the task; this is added for the network.
STOP_MARGIN_S = 5.0
JOIN_CONNECT_TIMEOUT_S = 0.5
# How much of a task's log end is read for the helper's last line (`log_ends_with_death`).
_TAIL_BYTES = 4096
# Run files a task writes; on machines that do not share the run dir the helper creates their folders.
_TASK_FILES = (contract.ERROR_FILE, contract.STATUS_FILE, contract.METRICS_FILE)


def relayed_status(code: int | None, log_file: str) -> int | None:
    """A helper's relayed exit ``code`` as a local task's status: a death by SIGTERM as -15. The
    helper relays it as 143, which after a stop notice would read as a program that saved on its
    own SIGTERM handler (contract.EXIT_CODES); its last line in the log tells the two apart."""
    if code == 128 + signal.SIGTERM and log_ends_with_death(log_file):
        return -signal.SIGTERM
    return code


def log_ends_with_death(log_file: str) -> bool:
    """Whether the helper's last line in ``log_file`` says its task died of SIGTERM."""
    try:
        with open(log_file, "rb") as log:
            log.seek(max(0, os.fstat(log.fileno()).st_size - _TAIL_BYTES))
            return remote.ended_by(log.read(), signal.SIGTERM)
    except OSError:
        return False


def request_of(task: TaskPlan, umask: int | None, grace_s: float) -> dict:
    """The JSON request a task's remote helper (`distlaunch.host.remote`) reads: the task as
    data, with the folders of its run files to create there."""
    folders = {str(Path(task.env[name]).parent) for name in _TASK_FILES if name in task.env}
    folders |= {
        task.env[name] for name in (contract.RUN_DIR, contract.CHECKPOINT_DIR) if name in task.env
    }
    return {
        "argv": list(task.argv),
        "env": dict(task.env),
        "cwd": task.cwd or None,
        "mkdirs": sorted(folders),
        "umask": umask,
        "grace_s": grace_s,
        "heartbeat_s": HEARTBEAT_TIMEOUT_S,
        "cpus": list(task.cpus.ids),
    }
