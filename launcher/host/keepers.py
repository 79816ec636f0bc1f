"""The agent's keepers: each task (and each warm standby) on the host runs under a keeper,
`remote.py`'s `main` in a fork of the agent (`fork_keeper`).

A fork costs about a millisecond of CPU where starting an interpreter and importing the keeper
cost 30-40 ms, for every task and every restart of every task on the host (128 tasks on 16
hosts: 4 s of CPU). The fork closes everything of the agent's but its own pipes and drops the
agent's signal handlers before the keeper's code runs; its command line reads as the keeper's
(`KEEPER_TITLE`), so `ps` on the host tells the agent from its keepers. The agent holds each
keeper's stdin (EOF makes a keeper SIGKILL its task's group at once) and reads its stdout (the
task's output and the keeper's own lines): when the agent dies every keeper sees EOF, and nothing
of the run is left on the host.

The agent starts no thread, so each fork copies a process that is whole.
"""

from __future__ import annotations

import json
import os
import select
import selectors
import signal
import sys

from distlaunch.host import gpu_share, remote

# What a keeper's command line reads on the host (as much of it as the agent's own has room for).
KEEPER_TITLE = "distlaunch.host.remote: keeper of task %d"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class Keeper:
    """One task's keeper process (a fork of the agent, `fork_keeper`), its pipes and what is
    known of its end."""

    def __init__(self, task: int, request: dict, pass_fds: tuple[int, ...] = ()) -> None:
        self.task = task
        # Before the fork: a share of GPUs the step does not hold starts nothing (NoShare).
        request = task_request(request)
        self.pid, stdin, self.out = fork_keeper(task, pass_fds)
        self.stdin = os.fdopen(stdin, "wb")
        os.set_blocking(self.out, False)
        self.pidfd = os.pidfd_open(self.pid)
        self.out_open = True
        self.reading = False  # its output is watched (`read_output`)
        self.exited_at: float | None = None
        self.code: int | None = None
        self.send(json.dumps(request).encode())

    def send(self, line: bytes) -> None:
        """Write one line to the keeper; one that has exited no longer reads."""
        if self.stdin.closed:
            return
        try:
            self.stdin.write(line + b"\n")
            self.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def read_output(self, sel: selectors.BaseSelector, on: bool) -> None:
        """Watch the keeper's output (or stop, while the launcher's channel is full: the task
        then blocks on its own writes)."""
        if not self.out_open or on == self.reading:
            return
        if on:
            sel.register(self.out, selectors.EVENT_READ, ("out", self))
        else:
            sel.unregister(self.out)
        self.reading = on

    def close_out(self, sel: selectors.BaseSelector) -> None:
        """Stop reading the keeper's output (its end, or it has had DRAIN_S since its exit)."""
        self.read_output(sel, False)
        self.out_open = False
        os.close(self.out)

    def wait(self, timeout: float | None = None) -> int | None:
        """The keeper's exit code (negative: the signal that ended it), once it has exited
        (within ``timeout`` seconds; None if it has not)."""
        if self.code is None and select.select([self.pidfd], [], [], timeout)[0]:
            _, status = os.waitpid(self.pid, 0)
            self.code = os.waitstatus_to_exitcode(status)
        return self.code

    def kill(self) -> None:
        """SIGKILL the keeper (its task dies with it: its parent-death signal)."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close_stdin(self) -> None:
        """EOF: the keeper SIGKILLs its task's group at once."""
        try:
            self.stdin.close()
        except (BrokenPipeError, OSError):
            pass


def task_request(request: dict) -> dict:
    """The request as a keeper gets it (`remote.py`'s first line): the one place on the host
    where a task's request, its environment included, is finalized before its keeper starts it."""
    # Its own GPUs of the step's (a Slurm node's: gpu_share); its heartbeat is its stdin
    # staying open: the agent watches the launcher's. NoShare (an OSError): the step lacks them.
    return {**gpu_share.with_share(request, os.environ), "heartbeat_s": None}


def fork_keeper(task: int, pass_fds: tuple[int, ...]) -> tuple[int, int, int]:
    """Fork the keeper of ``task``: its pid, the write end of its stdin and the read end of its
    output (stdout and stderr). The child keeps its pipes as 0, 1 and 2 and ``pass_fds`` under
    their numbers, and nothing else of the agent's; it runs `remote.main` and exits with its
    code. The agent starts no thread, so the fork copies a process that is whole."""
    stdin_r, stdin_w = os.pipe2(os.O_CLOEXEC)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    try:
        pid = os.fork()
    except OSError:
        for fd in (stdin_r, stdin_w, out_r, out_w):
            os.close(fd)
        raise
    if pid == 0:  # the keeper: nothing here may return into the agent's code
        code = 1
        try:
            code = _be_keeper(task, stdin_r, out_w, pass_fds)
        finally:
            os._exit(code)
    os.close(stdin_r)
    os.close(out_w)
    return pid, stdin_w, out_r


def _be_keeper(task: int, stdin: int, out: int, pass_fds: tuple[int, ...]) -> int:
    """In the forked child: become the keeper of ``task`` (see `fork_keeper`)."""
    leave_agent_signals()
    os.dup2(stdin, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    close_all_but({0, 1, 2, *pass_fds})
    # Fresh streams over the new 0, 1 and 2: the agent's own may hold buffered bytes of its
    # channel, which must not come out here.
    sys.stdin = open(0, "rb", closefd=False)  # noqa: SIM115 (the keeper's, for its life)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    _retitle((KEEPER_TITLE % task).encode())
    try:
        return remote.main()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except OSError:
                pass


def leave_agent_signals() -> None:
    """In a fork of the agent: the agent's signal handlers and wakeup fd go; an ignored SIGTERM
    (a Slurm step's notice) stays ignored, as it did across the exec of a keeper, until the
    keeper's own handler takes it."""
    signal.set_wakeup_fd(-1)
    for sig in STOP_SIGNALS:
        if callable(signal.getsignal(sig)):
            signal.signal(sig, signal.SIG_DFL)


def _retitle(title: bytes) -> None:
    """Make this process's command line (/proc/self/cmdline, what `ps` shows) read ``title``:
    the kernel reads it from the process's own argv area, which is overwritten here, cut to that
    area's size, as setproctitle does on Linux: the area's last byte made non-zero tells the
    kernel to read the title up to its first zero byte, not the whole area as arguments."""
    import ctypes  # loaded already (the keepers' code uses it): not at the launcher's import

    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        # Fields 48 and 49 (arg_start, arg_end); the command name (field 2) may hold spaces.
        start, end = (int(x) for x in stat[stat.rindex(b")") + 2 :].split()[45:47])
    except (OSError, ValueError):
        return
    size = end - start
    if size > 1:
        ctypes.memmove(start, title[: size - 2].ljust(size - 1, b"\0") + b" ", size)


def close_all_but(keep: set[int]) -> None:
    """Close every descriptor of this process but ``keep``: by ranges between them
    (close_range(2) where the kernel has it, which `os.closerange` uses), up to the highest
    descriptor open, read from /proc/self/fd, never by a loop to SC_OPEN_MAX (a million where
    the limit is raised: a second of CPU per fork)."""
    try:
        highest = max(int(name) for name in os.listdir("/proc/self/fd"))
    except (OSError, ValueError):
        highest = os.sysconf("SC_OPEN_MAX") - 1
    low = 0
    for fd in sorted(keep):
        if fd > low:
            os.closerange(low, fd)
        low = max(low, fd + 1)
    os.closerange(low, highest + 1)
