"""What a keeper (`remote.py`) does to leave nothing of its task behind: signal the task's process
group, and sweep up every process left of it (the keeper is a subreaper: the task's orphans are
its children). Standard library only.
"""

from __future__ import annotations

import os
import signal


def sweep() -> None:
    """SIGKILL and reap every process left of the task: all are this subreaper's children by now,
    or become so when their parent is killed."""
    while True:
        found = children(os.getpid())
        if not found:
            return
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in found:  # one by one: waiting for any would also wait for a new orphan
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def children(parent: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except (OSError, ValueError):
            continue
        # Field 4 (ppid) follows the command name, which may itself hold spaces or parentheses.
        if int(stat[stat.rindex(b")") + 2 :].split()[1]) == parent:
            found.append(int(name))
    return found


def signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
