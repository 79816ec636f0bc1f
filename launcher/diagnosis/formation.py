"""Whether a multi-worker cluster formed: the coordination service's own word, from its log.

Every task can start its TensorFlow server and still the cluster never forms: a task that cannot
reach the coordination service's port (a firewall between hosts, a container network that drops
traffic, a host name that resolves to another machine) retries in silence, and its peers wait for
it in silence, for as long as TensorFlow's register timeout (an hour). The service's leader (the
chief, else worker 0) says who is missing each time a task connects: ``Waiting for 1/2 tasks to
connect.`` and ``Example stragglers:`` with one ``/job:worker/replica:0/task:1`` line each; once
all have, ``Waiting for 0/2``. Those are INFO lines of TensorFlow's C++ log: a program run with
``TF_CPP_MIN_LOG_LEVEL`` above 0 hides them, and then nothing is known here.

Reads the end of one log file; decides nothing.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

# Enough for the leader's last count: while a task is missing, the leader prints nothing after it.
TAIL_BYTES = 64 * 1024
_WAITING = re.compile(rb"Waiting for (\d+)/(\d+) tasks to connect\.")
_STRAGGLER = re.compile(rb"^/job:([A-Za-z_]+)/replica:\d+/task:(\d+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Formation:
    """The leader's latest count: ``missing`` of ``total`` tasks not connected, and the missing
    tasks it named (``worker-1``; it names a few, not always all)."""

    missing: int
    total: int
    stragglers: tuple[str, ...]


def leader(task_names: list[str]) -> str | None:
    """The task whose coordination service the others connect to: TensorFlow's default leader."""
    for name in ("chief-0", "worker-0"):
        if name in task_names:
            return name
    return None


def latest(log_file: str) -> Formation | None:
    """What the leader's log last said of the tasks that connected; None when it said nothing
    (the program logs no INFO lines, or uses no coordination service) or the log is unreadable."""
    try:
        with open(log_file, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - TAIL_BYTES))
            tail = f.read()
    except OSError:
        return None
    found = list(_WAITING.finditer(tail))
    if not found:
        return None
    last = found[-1]
    after = tail[last.end() :]
    # The straggler lines follow the count, up to the next count (there is none after the last).
    stragglers = tuple(f"{job.decode()}-{int(index)}" for job, index in _STRAGGLER.findall(after))
    return Formation(int(last.group(1)), int(last.group(2)), stragglers)
