"""Process-tree handling for local tasks: start each in its own process group, stop it for sure.

Four rules, each learned the hard way by other launchers:
- every task gets a new session (so a process group of its own, and no terminal's Ctrl-C reaches it:
  the launcher decides who stops when);
- teardown signals the whole group: SIGTERM, a grace period, then SIGKILL (MWMS workers blocked in
  a collective ignore SIGTERM);
- a task must not outlive a launcher that is killed outright: the kernel sends the task SIGKILL when
  the launcher dies (PR_SET_PDEATHSIG, set by taskinit after exec, never in a preexec_fn);
- nothing a task forked may outlive it: a local task runs in a PID namespace of its own (taskinit),
  which the kernel empties when the task ends, however it ends.
"""

from __future__ import annotations

import os
import resource
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from distlaunch.launcher.transports import taskinit

if TYPE_CHECKING:
    from distlaunch.launcher.plan.plan import TaskPlan

# Started by path with an isolated interpreter: it needs nothing but the standard library.
TASKINIT = taskinit.__file__
# How long the last processes of a killed task's PID namespace may take to be gone.
TREE_TIMEOUT_S = 30.0
# How often stop_groups looks for tasks that have exited, at most.
STOP_POLL_S = 0.01
# The soft limit on open files this process had before `raise_fd_limit`, which its tasks get
# back (None: not raised).
_tasks_nofile: int | None = None


def raise_fd_limit() -> None:
    """Raise this process's soft limit on open files to the hard limit.

    The launcher holds a few descriptors per task (a pidfd, the task's tree pipe, its log file;
    an SSH client's pipe): hundreds of tasks pass the usual soft limit of 1024. The hard limit
    is the user's to raise. Tasks get the soft limit back (taskinit's ``--nofile``), so a task
    runs under the limits it would have without the launcher.
    """
    global _tasks_nofile
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard and _tasks_nofile is None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        _tasks_nofile = soft


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    log_file: str,
    stdin: int = subprocess.DEVNULL,
    death_signal: int = signal.SIGKILL,
) -> subprocess.Popen:
    """Start ``argv`` as the leader of a new session, stdout and stderr appended to ``log_file``.

    ``stdin`` is DEVNULL, or PIPE for a task the launcher talks to (an SSH task's helper). It dies
    with the launcher (see taskinit): by ``death_signal``, SIGKILL, or SIGTERM for a client that
    must clean up elsewhere first (`srun` cancels its job step on SIGTERM, not on SIGKILL). Must
    be called from the main thread: the kernel's parent-death signal fires when the thread that
    forked the child exits, not the process.
    """
    flags = [] if death_signal == signal.SIGKILL else ["--death", str(int(death_signal))]
    return _start(argv, env, cwd, log_file, stdin, flags, ())


def spawn_client(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    death_signal: int | None = signal.SIGKILL,
) -> subprocess.Popen:
    """`spawn` a client the launcher talks to over pipes (a host's agent behind ssh): stdin,
    stdout and stderr are pipes of this process; it dies with the launcher as `spawn`'s do.

    ``death_signal`` None: a client that outlives the launcher, in a session of its own, to pass
    the EOF of its stdin on when the launcher dies (a Slurm node's agent behind `srun`: a signal
    would cancel the step, which SIGKILLs the agent before it can remove its firewall rules)."""
    if death_signal is None:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env={**os.environ, **env},
            start_new_session=True,
        )
    flags = [] if death_signal == signal.SIGKILL else ["--death", str(int(death_signal))]
    return _start(argv, env, cwd, None, subprocess.PIPE, flags, ())


def spawn_contained(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    log_file: str | int,
    namespaces: Mapping[str, int] | None = None,
    pass_fds: Sequence[int] = (),
    cpus: Sequence[int] = (),
) -> tuple[subprocess.Popen, int]:
    """`spawn` ``argv`` in a PID namespace of its own, so that every process it starts dies with it.

    ``namespaces`` maps ``user`` and ``net`` to descriptors of namespaces to enter first. Returns
    the process (taskinit's keeper, alone in its process group) and a descriptor that reads EOF
    once every process of the task is gone (see `wait_tree`). ``log_file`` may be an open
    descriptor (a warm standby's unnamed log), and ``pass_fds`` reach ``argv`` under their numbers.
    ``cpus``: the CPUs the task is pinned to (none: the launcher's own mask).
    """
    tree_r, tree_w = os.pipe2(os.O_CLOEXEC)
    fds = [tree_w, *(namespaces or {}).values(), *pass_fds]
    flags = ["--tree", str(tree_w)]
    flags += [a for kind, fd in (namespaces or {}).items() for a in (f"--{kind}", str(fd))]
    if cpus:
        flags += ["--cpus", ",".join(map(str, cpus))]
    try:
        return _start(argv, env, cwd, log_file, subprocess.DEVNULL, flags, fds), tree_r
    except BaseException:
        os.close(tree_r)
        raise
    finally:
        os.close(tree_w)


def _start(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    log_file: str | int | None,
    stdin: int,
    flags: list[str],
    pass_fds: Sequence[int],
) -> subprocess.Popen:
    if _tasks_nofile is not None:
        flags = [*flags, "--nofile", str(_tasks_nofile)]
    if log_file is None:  # a client whose output the launcher reads (`spawn_client`)
        fd, stderr = subprocess.PIPE, subprocess.PIPE
    elif isinstance(log_file, int):
        fd = os.dup(log_file)  # closed below like an opened one; the caller keeps its own
    else:
        fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    if log_file is not None:
        stderr = subprocess.STDOUT
    try:
        # No preexec_fn: taskinit sets the parent-death signal itself, after exec.
        return subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-S",
                TASKINIT,
                "--parent",
                str(os.getpid()),
                *flags,
                "--",
                *argv,
            ],
            stdin=stdin,
            stdout=fd,
            stderr=stderr,
            cwd=cwd,
            env={**os.environ, **env},
            start_new_session=True,
            pass_fds=tuple(pass_fds),
        )
    finally:
        if fd != subprocess.PIPE:
            os.close(fd)


def wait_tree(tree_fd: int, timeout_s: float = TREE_TIMEOUT_S) -> bool:
    """Wait until every process of a contained task is gone (``tree_fd`` reads EOF); False if
    some are still there after ``timeout_s``."""
    # poll, not select: with hundreds of tasks the descriptor may be past select's 1024.
    poller = select.poll()
    poller.register(tree_fd, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


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


def stop_groups(procs: Iterable[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every task's group, wait up to ``grace_s`` for them to exit, then SIGKILL the rest.

    Each Popen's pid is its group id (the task leads its own session). Leaders are reaped here so
    no zombie is left behind.
    """
    procs = list(procs)
    for proc in procs:
        signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    # One loop over all of them (a reap attempt each, then one short sleep), not a timed wait
    # per task: Popen.wait(timeout) sleeps in steps of up to 50 ms, for each task in turn.
    pending, pause = procs, 0.001
    while True:
        pending = [proc for proc in pending if proc.poll() is None]
        left = deadline - time.monotonic()
        if not pending or left <= 0:
            break
        time.sleep(min(pause, left))
        pause = min(pause * 2, STOP_POLL_S)
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
    return port in listening_ports(pid)


def listening_ports(pid: int) -> set[int]:
    """The TCP ports with a listening socket in the network namespace of process ``pid`` (see
    `listening`): one read of the namespace's socket tables answers for all of its tasks."""
    found = set()
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}", encoding="ascii") as f:
                next(f, None)
                for line in f:
                    fields = line.split(None, 4)
                    # fields[1] is local_address (hex ip:port), fields[3] the state; 0A is LISTEN.
                    if len(fields) > 3 and fields[3] == "0A":
                        found.add(int(fields[1].rsplit(":", 1)[1], 16))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


def tcp_sockets_in_use(pid: int) -> tuple[int, int] | None:
    """How many IPv4 and IPv6 TCP sockets are in use (listening or connected) in the network
    namespace of process ``pid``; None when that cannot be read.

    A tenth of a millisecond, where reading the socket tables (`listening_ports`) takes tens of
    milliseconds even for an empty namespace: the kernel walks every namespace's sockets to
    find its own. A socket starts to count when it listens or connects.
    """
    counts = []
    for name, label in (("sockstat", b"TCP:"), ("sockstat6", b"TCP6:")):
        try:
            with open(f"/proc/{pid}/net/{name}", "rb") as f:
                text = f.read()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            return None
        for line in text.splitlines():
            fields = line.split()
            if fields[:2] == [label, b"inuse"] and len(fields) > 2:
                counts.append(int(fields[2]))
                break
        else:
            return None
    return counts[0], counts[1]


class TaskProcess:
    """A `transports.base.TaskHandle` for a task that a local process stands for (the task itself,
    its ssh client or its `compose run`): the process (its pid is also its process group id) and
    a pidfd on it."""

    # a warm standby became this task (local tasks only; see launcher/transports/local/standby.py)
    warm = False

    def __init__(self, task: TaskPlan, proc: subprocess.Popen, tree_fd: int | None = None) -> None:
        self.task = task
        self.proc = proc
        # For a contained task: reads EOF once every process of the task is gone.
        self.tree_fd = tree_fd
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

    def wait_tree(self) -> None:
        """After the process exited: wait until nothing it started is left (contained tasks)."""
        if self.tree_fd is not None:
            wait_tree(self.tree_fd)

    def close(self) -> None:
        """Wait for the task's last processes to be gone, then release the descriptors (once)."""
        self.wait_tree()
        if self.exit_fd >= 0:
            os.close(self.exit_fd)
            self.exit_fd = -1
        if self.tree_fd is not None:
            os.close(self.tree_fd)
            self.tree_fd = None
