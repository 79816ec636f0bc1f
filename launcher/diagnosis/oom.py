"""Whether the kernel's OOM killer ended a task, told as "killed by the OOM killer (RSS N GB)".

A task killed for memory dies of SIGKILL (exit 137 through a shell or SSH) and prints nothing:
without this the summary would say "signal SIGKILL", which reads like someone killed it. The
kernel says who it killed in its log (`Killed process PID` / `oom-kill:... pid=PID`, readable in
/dev/kmsg by root or with `dmesg`); the RSS shown is the task's last one sampled by the
supervisor (psutil, every check), since the process is gone by the time anyone asks.

The log is read record by record (tens of milliseconds on a busy machine), so it is read only
once the kernel's count of OOM kills (/proc/vmstat ``oom_kill``, all cgroups included) has moved
since the run began: an ordinary SIGKILL (a restart's, a user's kill -9) costs one small read.

Reads only: it never signals anything.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess

# How an OOM kill is told (the start of kill_of's words): the API tells the kind by them.
WORDS = "killed by the OOM killer"
# How much of the kernel's log is read at once (its ring buffer is usually 256 KiB to 1 MiB).
_KMSG_READ = 1 << 20


class OomKills:
    """Tells OOM kills of a run's tasks; made when the run begins."""

    def __init__(self) -> None:
        self.before = oom_kill_count()

    def kill_of(self, pid: int, returncode: int, rss_bytes: int | None) -> str:
        """``killed by the OOM killer (RSS N GB)`` when the kernel's log names ``pid`` as killed
        for memory and the task died of SIGKILL; else an empty string."""
        if returncode not in (-signal.SIGKILL, 128 + signal.SIGKILL):
            return ""
        if self.before is not None and oom_kill_count() == self.before:
            return ""  # the kernel has killed nothing for memory since the run began
        if not killed_for_memory(pid, kernel_log()):
            return ""
        rss = f" (RSS {rss_bytes / 1e9:.1f} GB)" if rss_bytes else ""
        return f"{WORDS}{rss}"


def oom_kill_count() -> int | None:
    """How many processes the OOM killer has killed since boot; None where the kernel does not
    say (before Linux 4.13, or no /proc): then every SIGKILL is looked up in the log."""
    try:
        with open("/proc/vmstat", "rb") as f:
            for line in f:
                if line.startswith(b"oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def killed_for_memory(pid: int, log: str) -> bool:
    """Whether the kernel log text ``log`` says the OOM killer killed ``pid``."""
    pattern = (
        rf"(Killed process {pid}\b|oom-kill:.*\bpid={pid}\b"
        rf"|Memory cgroup out of memory: Kill(ed)? process {pid}\b)"
    )
    return re.search(pattern, log) is not None


def kernel_log() -> str:
    """The kernel's log as far as this user may read it (/dev/kmsg, else `dmesg`); "" if neither."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        fd = -1
    if fd >= 0:
        lines = []
        try:
            while True:
                try:
                    lines.append(os.read(fd, 8192).decode("utf-8", "replace"))
                except BlockingIOError:
                    break
                except OSError:  # EPIPE: a record was overwritten while reading; go on
                    continue
                if sum(map(len, lines)) > _KMSG_READ * 4:
                    break
        finally:
            os.close(fd)
        if lines:
            return "".join(lines)
    try:
        return subprocess.run(
            ["dmesg"], check=False, capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
