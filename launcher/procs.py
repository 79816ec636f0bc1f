"""Process-tree handling for local tasks: start each in its own process group, stop it for sure.

Three rules, each learned the hard way by other launchers:
- every task gets a new session (so a process group of its own, and no terminal's Ctrl-C reaches it:
  the launcher decides who stops when);
- teardown signals the whole group: SIGTERM, a grace period, then SIGKILL (MWMS workers blocked in
  a collective ignore SIGTERM);
- a task must not outlive a launcher that is killed outright: the kernel sends the task SIGKILL when
  the launcher dies (PR_SET_PDEATHSIG), and run.json keeps every process group id so that
  `distlaunch down` can sweep what a task itself forked.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distlaunch.launcher.plan import TaskPlan

_PR_SET_PDEATHSIG = 1
# Resolved before any fork: the child must do as little as possible between fork and exec.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent(parent_pid: int):
    def preexec() -> None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # The launcher may have died between fork and prctl: then nobody would kill us.
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


def spawn(
    argv: Sequence[str], env: Mapping[str, str], cwd: str, log_file: str, stdin: int = subprocess.DEVNULL
) -> subprocess.Popen:
    """Start ``argv`` as the leader of a new session, stdout and stderr appended to ``log_file``.

    ``stdin`` is DEVNULL, or PIPE for a task the launcher talks to (an SSH task's helper).
    Must be called from the main thread: the kernel's parent-death signal fires when the thread
    that forked the child exits, not the process.
    """
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        return subprocess.Popen(
            list(argv),
            stdin=stdin,
            stdout=fd,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env={**os.environ, **env},
            start_new_session=True,
            preexec_fn=_die_with_parent(os.getpid()),
        )
    finally:
        os.close(fd)


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; return False when the group is already gone."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        # The group id was reused by someone else's process: not ours to signal.
        return False


def group_alive(pgid: int) -> bool:
    """Whether any process is left in group ``pgid`` (signal 0 probes without signalling)."""
    return signal_group(pgid, 0)


def stop_groups(procs: Iterable[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every task's group, wait up to ``grace_s`` for them to exit, then SIGKILL the rest.

    Each Popen's pid is its group id (the task leads its own session). Leaders are reaped here so
    no zombie is left behind.
    """
    procs = list(procs)
    for proc in procs:
        signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        remaining = deadline - time.monotonic()
        try:
            proc.wait(timeout=max(remaining, 0))
        except subprocess.TimeoutExpired:
            pass
    kill_groups(procs)


def kill_groups(procs: Iterable[subprocess.Popen]) -> None:
    """SIGKILL every task's group and reap its leader."""
    for proc in procs:
        # Also kills what the task forked, even when the leader has already exited.
        signal_group(proc.pid, signal.SIGKILL)
        proc.wait()


def listening(pid: int, port: int) -> bool:
    """Whether a TCP socket listens on ``port`` in the network namespace of process ``pid``.

    TensorFlow starts its gRPC server when a task joins its cluster, so this tells from outside,
    without the task's help, that it got that far. Reading /proc/PID/net sees the task's own
    network namespace, which is right also when tasks run in a private one.
    """
    wanted = f":{port:04X} "
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}", encoding="ascii") as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    # fields[1] is local_address (hex ip:port), fields[3] the state; 0A is LISTEN.
                    if len(fields) > 3 and fields[3] == "0A" and (fields[1] + " ").endswith(wanted):
                        return True
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return False


def pid_alive(pid: object) -> bool:
    """Whether ``pid`` is an int naming a live process (one of another user's counts as alive)."""
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class TaskProcess:
    """A `transports.base.TaskHandle` for a task that a local process stands for (the task itself,
    its ssh client or its `compose run`): the process (its pid is also its process group id) and
    a pidfd on it."""

    def __init__(self, task: TaskPlan, proc: subprocess.Popen) -> None:
        self.task = task
        self.proc = proc
        # A pidfd turns "the process exited" into an fd event: the supervisor's select loop
        # learns of an exit at once, with no polling sleep in the way.
        self.exit_fd = os.pidfd_open(proc.pid)

    @property
    def pid(self) -> int:
        """The local process's pid, which is also its process group id."""
        return self.proc.pid

    def exit_status(self) -> int | None:
        """Reap the local process if it has exited; its return code, or None while it runs."""
        return self.proc.poll()

    def close(self) -> None:
        """Release the pidfd (once: a restart closes the old handle, teardown every handle)."""
        if self.exit_fd >= 0:
            os.close(self.exit_fd)
            self.exit_fd = -1
