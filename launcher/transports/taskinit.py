"""The first process of every local task: it makes sure that nothing the task starts outlives it.

The launcher runs ``python -I -S taskinit.py --parent PID [--death SIG] [--tree FD] [--user FD]
[--net FD] [--nofile N] [--cpus LIST] -- ARGV...`` (standard library only, run by path: any interpreter works, nothing is
imported from the task's environment). Everything is done here, after exec, and nothing in a
``preexec_fn``: Python's ``preexec_fn`` is unsafe while the launcher has other threads (SSH's
heartbeat), a child can deadlock between fork and exec.

1. Parent death: ``PR_SET_PDEATHSIG`` = SIGKILL (``--death SIG``: another signal; SIGTERM for
   `srun`, which cancels its Slurm job step on SIGTERM but leaves it running when SIGKILLed), then
   a check that the launcher did not die before that (the ``--parent`` pid is still our parent).
With ``--nofile N``, the soft limit on open files goes back to N, the user's own, which the
launcher raised for itself (procs.raise_fd_limit). With ``--cpus 0,1``, the task is pinned to those
CPUs (its share of the machine: launcher/plan/cpu_fit.py) before anything else runs, so that
TensorFlow sizes its thread pools to them and every process the task starts inherits the mask.

2. Namespaces by file descriptor (``--user``, ``--net``: the run's network namespace, held open by
   the launcher): ``setns`` on the descriptor, never on a pid that could have been reused.
3. Without ``--tree``: exec ARGV (the SSH and compose clients, whose remote ends sweep their own
   trees).
4. With ``--tree``: a new PID namespace. This process (the *keeper*, the pid the launcher sees)
   forks the namespace's init, which forks and execs the task. When the task exits, the init
   exits and the kernel kills every process left in the namespace, also those that called
   ``setsid``; when the keeper is killed (the launcher SIGKILLs it, or the launcher itself died),
   the init gets KEEPER_GONE as its parent-death signal and SIGKILLs and reaps every process of
   the namespace itself before it exits (left to the kernel, the init's descriptors would close
   before the namespace is empty: a warm standby could then find the port still held). The keeper
   exits only after the init, so once the launcher has reaped the keeper, and the write end of
   the ``--tree`` pipe (held by the init alone) is closed, not one process of the task is left.
   A new mount namespace gets its own ``/proc``, so ``os.getpid()`` and ``/proc/<pid>`` agree.
   An unprivileged user gets the PID namespace inside a user namespace of its own (its uid and gid
   mapped to themselves). Where the kernel refuses both, the keeper is a child subreaper
   instead: it kills what is left when the task exits, but not when it is itself SIGKILLed.

Signals: the keeper is alone in its process group, so the launcher's ``killpg`` reaches only it;
it forwards SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 to the init, which forwards them
to the task's process group. The task thus gets each signal once, exactly as before. The keeper
exits the way the task did: its exit code, or death by the same signal.

A stop notice (the launcher asks the task to save and stop: worker/preempt.py) is NOTICE sent to
the keeper, which forwards it to the init; the init, which kept the task's pid, sends SIGTERM to
that one process: never to its children (a data loader's worker, a shell's child), whose death
or own handler could break the save.
"""

from __future__ import annotations

import os
import resource
import select
import signal
import sys

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
# The init's parent-death signal: not one the task could be sent (FORWARDED) and caught, so that
# the init empties the namespace before it exits.
KEEPER_GONE = signal.SIGRTMIN
# A stop notice for the task's program alone (see the module docstring); it arrives as SIGTERM.
NOTICE = signal.SIGRTMIN + 1
# Exit codes when the task's program cannot be started, as POSIX shells use them.
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127


def main(args: list[str]) -> None:
    """Parse ``args`` (see the module docstring) and run the task; never returns."""
    options, cpus, argv = _parse(args)
    _libc.prctl(_PR_SET_PDEATHSIG, options.get("death", signal.SIGKILL), 0, 0, 0)
    if os.getppid() != options["parent"]:
        os._exit(1)  # the launcher died before the line above: nobody would ever kill us
    if "nofile" in options:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(options["nofile"], hard), hard))
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as exc:  # a CPU gone offline, or taken away by a cgroup, since the plan
            sys.stderr.write(f"distlaunch: cannot pin the task to CPUs {cpus}: {exc.strerror}\n")
            sys.stderr.flush()
            os._exit(EXIT_NOT_EXECUTABLE)
    for flag, kind in (("user", _CLONE_NEWUSER), ("net", _CLONE_NEWNET)):
        if flag in options:
            _call("setns", options[flag], kind)
            os.close(options[flag])
    if "tree" not in options:
        _exec(argv)
    # Until the child to forward to exists.
    signal.pthread_sigmask(signal.SIG_BLOCK, (*FORWARDED, NOTICE))
    if _try_call("unshare", _CLONE_NEWPID) == 0 or _own_user_namespace():
        _keeper(argv, options["tree"])
    _subreaper(argv, options["tree"])


def _parse(args: list[str]) -> tuple[dict[str, int], list[int], list[str]]:
    split = args.index("--")
    flags, argv = args[:split], args[split + 1 :]
    pairs = {flags[i].removeprefix("--"): flags[i + 1] for i in range(0, len(flags), 2)}
    cpus = [int(c) for c in pairs.pop("cpus", "").split(",") if c]
    options = {name: int(value) for name, value in pairs.items()}
    if "parent" not in options or not argv:
        sys.exit(
            "usage: taskinit.py --parent PID [--death SIG] [--tree FD] [--user FD] [--net FD] "
            "[--nofile N] [--cpus LIST] -- ARGV..."
        )
    return options, cpus, argv


def _own_user_namespace() -> bool:
    """A PID namespace inside a new user namespace, for a user who may not make one otherwise.

    The user's own uid and gid map to themselves, so the task sees the ids it always had.
    """
    uid, gid = os.getuid(), os.getgid()
    if _try_call("unshare", _CLONE_NEWUSER | _CLONE_NEWPID) != 0:
        return False
    try:
        for name, text in (
            ("setgroups", "deny"),
            ("uid_map", f"{uid} {uid} 1"),
            ("gid_map", f"{gid} {gid} 1"),
        ):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    except OSError:
        pass  # unmapped ids then read as the overflow id; the containment still holds
    return True


def _keeper(argv: list[str], tree_fd: int) -> None:
    """Fork the PID namespace's init, forward signals to it, and exit as the task did."""
    # The init checks this pipe for EOF to learn whether the keeper died before PDEATHSIG was set.
    alive_r, alive_w = os.pipe()
    status_r, status_w = os.pipe()
    # A new mount namespace too (best effort), so that the init can mount the namespace's /proc.
    mounts = _try_call("unshare", _CLONE_NEWNS) == 0
    init = os.fork()
    if init == 0:
        os.close(alive_w)
        os.close(status_r)
        _init(argv, tree_fd, alive_r, status_w, mounts)
    os.close(alive_r)
    os.close(status_w)
    os.close(tree_fd)  # the init's copy closes when the namespace is empty
    _forward_to(lambda sig: os.kill(init, sig), notice=lambda: os.kill(init, NOTICE))
    _, status = os.waitpid(init, 0)
    with os.fdopen(status_r, "rb") as pipe:
        reported = pipe.read()
    # The init reports the task's wait status; without it (the init was killed) report its own.
    _exit_like(int(reported) if reported else status)


def _init(argv: list[str], tree_fd: int, alive_r: int, status_w: int, mounts: bool) -> None:
    """PID 1 of the task's namespace: start the task, reap every orphan, exit when the task does."""
    signal.signal(KEEPER_GONE, _empty_namespace)
    _libc.prctl(_PR_SET_PDEATHSIG, KEEPER_GONE, 0, 0, 0)
    if select.select([alive_r], [], [], 0)[0]:
        os._exit(1)  # EOF: the keeper is already gone
    os.setsid()  # out of the keeper's group: the launcher's killpg reaches the keeper alone
    if mounts:
        _mount_proc()
    os.set_inheritable(tree_fd, False)  # held by the init alone: the task's exec drops it
    task = os.fork()
    if task == 0:
        os.setpgid(0, 0)
        _exec(argv)
    _own_group(task)
    _forward_to(lambda sig: _killpg(task, sig), notice=lambda: os.kill(task, signal.SIGTERM))
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(1)
        if pid == task:
            os.write(status_w, str(status).encode())
            # Exiting is the point: the kernel now kills whatever the task left in the namespace
            # and the keeper's wait returns only after all of it is gone.
            os._exit(0)


def _empty_namespace(_signum: int, _frame: object) -> None:
    """The keeper is gone: SIGKILL every other process of the namespace and reap them all, then
    exit; the ``--tree`` pipe then reads EOF only once nothing of the task is left."""
    if os.getpid() != 1:
        os._exit(1)  # not a namespace's init: kill(-1) would reach far more than the task
    while True:
        try:
            os.kill(-1, signal.SIGKILL)  # as PID 1: every process of its namespace but itself
        except ProcessLookupError:
            pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(1)


def _subreaper(argv: list[str], tree_fd: int) -> None:
    """No PID namespace here: adopt the task's orphans and kill what is left when the task exits."""
    _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    os.set_inheritable(tree_fd, False)
    task = os.fork()
    if task == 0:
        os.setpgid(0, 0)
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        _exec(argv)
    _own_group(task)
    _forward_to(lambda sig: _killpg(task, sig), notice=lambda: os.kill(task, signal.SIGTERM))
    _, status = os.waitpid(task, 0)
    while True:  # orphans of the task are our children now; kill until none is left
        children = _children(os.getpid())
        if not children:
            break
        for pid in children:
            _try_kill(pid)
        # One by one: waiting for any child would also wait for an orphan adopted meanwhile.
        for pid in children:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
    _exit_like(status)


def _children(parent: int) -> list[int]:
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


def _try_kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _mount_proc() -> None:
    """Give the namespace its own /proc, unless the mount cannot be kept from the host's."""
    # Private first: a mount must never propagate back into the launcher's mount namespace.
    if _libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) == 0:
        _libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None)


def _forward_to(send, notice) -> None:
    def forward(signum: int, _frame: object) -> None:
        try:
            if signum == NOTICE:
                notice()
            else:
                send(signum)
        except ProcessLookupError:
            pass

    for sig in (*FORWARDED, NOTICE):
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (*FORWARDED, NOTICE))


def _own_group(task: int) -> None:
    # Also done here, not only in the child: a signal to forward must find the group at once.
    try:
        os.setpgid(task, task)
    except OSError:
        pass  # the child has done it and exec'd already, or has exited


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _exec(argv: list[str]) -> None:
    # Python ignores SIGPIPE and SIGXFSZ; a program expects the defaults, as subprocess gives them.
    for sig in (*FORWARDED, NOTICE, signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        sys.stderr.write(f"distlaunch: cannot run {argv[0]}: {exc.strerror}\n")
        sys.stderr.flush()
        os._exit(
            EXIT_NOT_FOUND
            if isinstance(exc, (FileNotFoundError, NotADirectoryError))
            else EXIT_NOT_EXECUTABLE
        )


def _exit_like(status: int) -> None:
    """Exit with the code of wait status ``status``, or die of its signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        # A re-raised SIGSEGV must not dump this process's core.
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        # SIGKILL's (an OOM kill's) and SIGSTOP's disposition cannot be set (EINVAL).
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _call(name: str, *args: int) -> None:
    if getattr(_libc, name)(*args) != 0:
        errno = ctypes.get_errno()
        sys.stderr.write(f"distlaunch: {name} failed: {os.strerror(errno)}\n")
        os._exit(EXIT_NOT_EXECUTABLE)


def _try_call(name: str, *args: int) -> int:
    return getattr(_libc, name)(*args)


if __name__ == "__main__":
    # ctypes (~3 ms to import) is loaded in the task's process alone: the launcher imports this
    # module for its path and NOTICE on its way to a run's first task (bench/startup.py).
    import ctypes

    _libc = ctypes.CDLL(None, use_errno=True)
    main(sys.argv[1:])
