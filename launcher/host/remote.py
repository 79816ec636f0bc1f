"""The remote end of an SSH task: runs the task in its own process group and never lets it outlive the launcher.

The launcher runs ``ssh HOST 'exec PYTHON -m distlaunch.host.remote'`` and talks to this helper
over the SSH session's stdin, one line at a time:

- line 1 is a JSON request: ``{"argv": [...], "env": {...}, "cwd": "..." | null,
  "mkdirs": [...], "umask": 63 | null, "grace_s": 5, "heartbeat_s": 20, "cpus": [0, 1]}``
  (``cpus``: the CPUs the task is pinned to, its share of the host; none or empty: not pinned
  here; with ``"keep_bound": true``, a Slurm step, not where Slurm already bound it to as many;
  ``standby_fd``: a warm standby's control socket, passed on by the agent: the task gets it under
  that number and this helper closes its own copy once the task has started).
  Arguments, environment and paths arrive as data: no remote shell ever parses them. A ``cwd`` or program (``argv[0]``)
  starting with ``~/`` is relative to the home dir, as in the spec's host ``python`` and ``workdir``.
- every later line is either empty (a heartbeat: the launcher is alive), ``stop``, or
  ``notice``: a stop notice (worker/preempt.py), SIGTERM to the task's program process alone,
  never to what it forked (a data loader's workers), as taskinit's NOTICE does for a local task;
  the helper then goes on watching, and the task saves and exits on its own.

`distlaunch stacks` sends another first line instead, ``{"stacks": {"run_id": "...", "task":
"worker-1", "native": true}}``, answered by `distlaunch.host.stacks_query` (over SSH, as a Slurm
step on the task's node, and with `docker exec` into a container).

The task runs as the leader of a new session (so a process group of its own) with stdout and
stderr merged into this helper's stdout, which SSH streams back to the launcher's log file. The
group is stopped the way a local task's would be:

- ``stop`` arrives (the launcher tears the run down), or this helper gets SIGTERM, SIGHUP or
  SIGINT: SIGTERM, ``grace_s``, SIGKILL, as `LocalTransport.stop` does. With ``term_is_notice``
  (a Slurm job step: Slurm SIGTERMs every process of a job it requeues, preempts or ends at its
  time limit, and SIGKILLs them KillWait later) SIGTERM is a stop notice instead: the program
  alone gets it, and Slurm's SIGKILL or the launcher's ``stop`` is the deadline;
- stdin reaches EOF (the launcher died or killed the ssh client, or the connection closed: sshd
  then closes the channel), or no line arrives for ``heartbeat_s`` (the network vanished without
  a reset, which sshd may not notice for hours): SIGKILL at once. A local task gets exactly that
  when its launcher dies (PR_SET_PDEATHSIG) or restarts it, and a restarted task needs its port
  back now, not after a grace period nobody is waiting for.

The helper exits with the task's exit code, or 128+N when the task died of signal N (SSH cannot
carry a signal death). It imports neither launcher code nor TensorFlow, only the standard library
and its own package (Linux >= 5.3 for pidfd); a Slurm job step runs it by path as ``PYTHON -I -S
.../remote.py``, without site-packages: its package is then its folder (`package_here`).
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import signal
import subprocess
import sys
import time
import types
from typing import Any


def package_here() -> None:
    """Where distlaunch cannot be imported (this file run by path, without site-packages: a
    Slurm step), make `distlaunch.host` this file's folder, so that its modules import each
    other by their names as anywhere else."""
    try:
        import distlaunch.host  # noqa: F401
    except ImportError:
        for name, path in (("distlaunch", []), ("distlaunch.host", [os.path.dirname(__file__)])):
            module = types.ModuleType(name)
            module.__path__ = path
            sys.modules[name] = module


if not __package__:  # run by path (a Slurm step), or imported so by the agent run by path
    package_here()

from distlaunch.host import sweep  # noqa: E402

# Bumped whenever the request format, the agent's channel (distlaunch.host.channel, which has the
# same number) or the worker contract changes; preflight refuses a host that speaks another.
PROTOCOL = 6  # 5: warm standbys (``standby_fd``); 6: the agent's hello frame, typed commands
STOP = b"stop"
NOTICE = b"notice"
# Exit codes for a task that could not be started, as POSIX shells use them.
EXIT_BAD_REQUEST = 125
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
# After the task's leader exits on its own, how long what it forked gets to follow a SIGTERM.
LEFTOVER_GRACE_S = 1.0
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
# How each line this helper says itself begins (on its stderr: the task's log).
_SAID = "distlaunch.host.remote: "


def main() -> int:
    """Run one task as the request on stdin says; return its exit code (128+N for signal N)."""
    stdin = _LineReader(sys.stdin.fileno())
    try:
        line = stdin.first_line()
        if line is not None and b'"stacks"' in line:
            query = json.loads(line).get("stacks")
            if isinstance(query, dict):
                from distlaunch.host import stacks_query  # only for this query

                return stacks_query.answer(query, say)
        request = _parse(line)
    except (ValueError, TypeError) as exc:
        say(f"bad request from the launcher: {exc}")
        return EXIT_BAD_REQUEST
    # Signals are trapped before the task exists: a stop signal arriving in between must still
    # reach the task instead of killing this helper alone.
    watch = _Watch(stdin, request["grace_s"], request["heartbeat_s"], request["term_is_notice"])
    # Orphans of the task (a child that called setsid, a double-forked daemon) become this
    # helper's children instead of init's, so that `_sweep` can find and kill them.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    if request["umask"] is not None:
        os.umask(request["umask"])  # the task inherits it, as a local task inherits the launcher's
    try:
        for path in request["mkdirs"]:
            os.makedirs(path, exist_ok=True)
        bound = os.sched_getaffinity(0)
        if request["cpus"] and not (
            request["keep_bound"]
            and (len(bound) <= len(request["cpus"]) or not set(request["cpus"]) <= bound)
        ):
            # Pinned here, before the start: the task inherits the mask, so TensorFlow sizes its
            # thread pools to it from its first line (this helper only waits, on any CPU). A
            # Slurm step already bound to its share (``keep_bound``) keeps Slurm's CPUs, and so
            # does a node's agent step that Slurm bound to CPUs other than the plan's.
            os.sched_setaffinity(0, request["cpus"])
        child = _start(request)
        if request["standby_fd"] is not None:
            # Only the standby holds its control socket now: the agent reads its EOF when the
            # standby dies.
            os.close(request["standby_fd"])
    except OSError as exc:
        say(f"cannot start the task: {exc}")
        return (
            EXIT_NOT_FOUND
            if isinstance(exc, (FileNotFoundError, NotADirectoryError))
            else EXIT_NOT_EXECUTABLE
        )
    return watch.run(child)


def _parse(line: bytes | None) -> dict[str, Any]:
    if line is None:
        raise ValueError("stdin closed before the request line")
    request = json.loads(line)
    if not isinstance(request, dict):
        raise ValueError("expected a JSON object")
    argv, env, cwd = request.get("argv"), request.get("env", {}), request.get("cwd")
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        raise ValueError("argv must be a non-empty list of strings")
    if not (
        isinstance(env, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        raise ValueError("env must map strings to strings")
    if cwd is not None and not isinstance(cwd, str):
        raise ValueError("cwd must be a string or null")
    cpus = request.get("cpus") or []
    if not (isinstance(cpus, list) and all(type(c) is int and c >= 0 for c in cpus)):
        raise ValueError("cpus must be a list of CPU ids")
    standby_fd = request.get("standby_fd")
    if standby_fd is not None and not (type(standby_fd) is int and standby_fd > 2):
        raise ValueError("standby_fd must be a descriptor number above 2")
    return {
        "argv": [_home(argv[0]), *argv[1:]],
        "env": env,
        "cwd": _home(cwd) if cwd else None,
        "mkdirs": [str(p) for p in request.get("mkdirs", [])],
        "umask": int(request["umask"]) if request.get("umask") is not None else None,
        "grace_s": float(request.get("grace_s", 5.0)),
        "heartbeat_s": float(request["heartbeat_s"]) if request.get("heartbeat_s") else None,
        "term_is_notice": bool(request.get("term_is_notice")),
        "cpus": cpus,
        "keep_bound": bool(request.get("keep_bound")),
        "standby_fd": standby_fd,
    }


def _home(path: str) -> str:
    """``path`` with a leading ``~`` or ``~/`` made the home dir (nothing else is expanded)."""
    return os.path.expanduser(path) if path == "~" or path.startswith("~/") else path


def _start(request: dict[str, Any]) -> subprocess.Popen:
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def die_with_helper() -> None:
        # Safe in a preexec_fn: this helper never starts a thread.
        # If this helper is SIGKILLed, the kernel kills the task's leader too (not what the
        # leader forked: that takes the helper's own cleanup, which SIGKILL skips).
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    sys.stdout.flush()
    return subprocess.Popen(
        request["argv"],
        stdin=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,  # one ordered stream, as a local task's log file gets
        cwd=request["cwd"],
        env={**os.environ, **request["env"]},
        start_new_session=True,
        preexec_fn=die_with_helper,
        # A standby's control socket (the agent's warm standbys), under its own number.
        pass_fds=() if request["standby_fd"] is None else (request["standby_fd"],),
    )


class _LineReader:
    """Reads lines from a raw fd without read-ahead buffering, so `select` on it stays truthful."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = b""
        self.eof = False

    def first_line(self) -> bytes | None:
        """Block until the first complete line (None on EOF before one)."""
        while b"\n" not in self._buffer:
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def read_lines(self) -> list[bytes]:
        """Read what is available now (the fd is readable) and return the complete lines."""
        chunk = os.read(self.fd, 65536)
        if not chunk:
            self.eof = True
            return []
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        return lines

    def pending_lines(self) -> list[bytes]:
        """Complete lines that arrived along with the first one."""
        *lines, self._buffer = self._buffer.split(b"\n")
        return lines


class _Watch:
    """Waits for the task to exit, or for a reason to stop it, in one select loop."""

    def __init__(
        self,
        stdin: _LineReader,
        grace_s: float,
        heartbeat_s: float | None,
        term_is_notice: bool = False,
    ) -> None:
        self.stdin = stdin
        self.grace_s = grace_s
        self.heartbeat_s = heartbeat_s
        self.term_is_notice = term_is_notice
        self._signal: int | None = None
        self._term_notice = False  # a SIGTERM that is a notice came, not yet passed on
        self._wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        for sig in _STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        signal.set_wakeup_fd(wake_w)

    def run(self, child: subprocess.Popen) -> int:
        """Supervise ``child`` until it exits or must be stopped; return the exit code to report."""
        self.child = child
        sel = selectors.DefaultSelector()
        sel.register(os.pidfd_open(child.pid), selectors.EVENT_READ, "exit")
        sel.register(self.stdin.fd, selectors.EVENT_READ, "stdin")
        sel.register(self._wake_r, selectors.EVENT_READ, "signal")
        reason = self._signal_reason() or self._reason(self.stdin.pending_lines())
        self._pass_term_notice()
        last_heard = time.monotonic()
        lost = None
        while reason is None and lost is None:
            timeout = None
            if self.heartbeat_s is not None:
                timeout = max(0.0, last_heard + self.heartbeat_s - time.monotonic())
            for key, _ in sel.select(timeout):
                if key.data == "exit":
                    return self._finish(self._leftovers())
                if key.data == "stdin":
                    last_heard = time.monotonic()
                    reason = self._reason(self.stdin.read_lines())
                    if self.stdin.eof:
                        lost = "the launcher's connection closed"
                if key.data == "signal":
                    try:
                        os.read(self._wake_r, 512)  # a notice keeps the loop going: drain it
                    except BlockingIOError:
                        pass
                    reason = self._signal_reason()
            self._pass_term_notice()
            if self.heartbeat_s is not None and time.monotonic() - last_heard > self.heartbeat_s:
                lost = f"no word from the launcher for {self.heartbeat_s:g} s"
        if reason is None:  # a `stop` that came with the EOF still gets its grace
            say(f"killing the task: {lost}")
            return self._finish(self._stop_group(0.0))
        say(f"stopping the task: {reason}")
        return self._finish(self._stop_group(self.grace_s))

    def _signal_reason(self) -> str | None:
        return f"this helper got {_signal_name(self._signal)}" if self._signal else None

    def _on_signal(self, signum: int, _frame: object) -> None:
        if signum == signal.SIGTERM and self.term_is_notice:
            self._term_notice = True
        elif self._signal is None:
            self._signal = signum

    def _pass_term_notice(self) -> None:
        if self._term_notice:
            self._term_notice = False
            self._notice()

    def _reason(self, lines: list[bytes]) -> str | None:
        # Any line is a heartbeat; only `stop` and `notice` ask for anything.
        if any(line.strip() == NOTICE for line in lines):
            self._notice()
        if any(line.strip() == STOP for line in lines):
            return "the launcher asked it to stop"
        return None

    def _notice(self) -> None:
        """A stop notice: SIGTERM to the task's program alone (the group's leader, which this
        helper started), not to its group."""
        try:
            os.kill(self.child.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass  # it has exited; its exit is about to be seen

    def _leftovers(self) -> int:
        """The leader exited: terminate whatever it left in its group, then return its code."""
        code = self.child.wait()
        if sweep.signal_group(self.child.pid, 0):
            sweep.signal_group(self.child.pid, signal.SIGTERM)
            deadline = time.monotonic() + LEFTOVER_GRACE_S
            while sweep.signal_group(self.child.pid, 0) and time.monotonic() < deadline:
                time.sleep(0.05)
            sweep.signal_group(self.child.pid, signal.SIGKILL)
        sweep.sweep()
        return code

    def _stop_group(self, grace_s: float) -> int:
        """SIGTERM the task's group, wait up to ``grace_s`` for the leader, then SIGKILL the group
        (at once when ``grace_s`` is 0)."""
        if grace_s > 0:
            sweep.signal_group(self.child.pid, signal.SIGTERM)
            try:
                self.child.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        # Also reaches what the task forked, even when the leader has already exited.
        sweep.signal_group(self.child.pid, signal.SIGKILL)
        code = self.child.wait()
        sweep.sweep()
        return code

    def _finish(self, code: int) -> int:
        if code < 0:
            say(signal_death(-code))
            return 128 - code
        return code


def signal_death(signum: int) -> str:
    """What this helper says, last, when its task died of signal ``signum``: the launcher finds
    it at the end of the task's log (`ended_by`) and so tells that death from a program's own
    exit with 128+N, which SSH and srun relay alike."""
    return f"the task was ended by {_signal_name(signum)}; exiting with {128 + signum}"


def ended_by(log_tail: bytes, signum: int) -> bool:
    """Whether ``log_tail``, the end of a task's log, ends with this helper's word that the task
    died of ``signum`` (`signal_death`)."""
    lines = log_tail.rstrip(b"\n").rsplit(b"\n", 1)
    return lines[-1] == f"{_SAID}{signal_death(signum)}".encode()


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def say(message: str) -> None:
    try:
        sys.stderr.write(f"{_SAID}{message}\n")
        sys.stderr.flush()
    except (BrokenPipeError, OSError):
        pass  # the channel is gone: nobody is left to tell


if __name__ == "__main__":
    sys.exit(main())
