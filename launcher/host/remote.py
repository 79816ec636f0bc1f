"""The remote end of an SSH task: runs the task in its own process group and never lets it outlive the launcher.

The launcher runs ``ssh HOST 'exec PYTHON -m distlaunch.host.remote'`` and talks to this helper
over the SSH session's stdin, one line at a time:

- line 1 is a JSON request: ``{"argv": [...], "env": {...}, "cwd": "..." | null,
  "mkdirs": [...], "umask": 63 | null, "grace_s": 5, "heartbeat_s": 20, "cpus": [0, 1]}``
  (``cpus``: the CPUs the task is pinned to, its share of the host; none or empty: not pinned
  here; with ``"keep_bound": true``, a Slurm step, not where Slurm already bound it to as many;
  ``standby_fd``: a warm standby's control socket, passed on by the agent: the task gets it under
  that number and this helper closes its own copy once the task has started).
  Arguments, environment
  and paths arrive as data: no remote shell ever parses them. A ``cwd`` or program (``argv[0]``)
  starting with ``~/`` is relative to the home dir, as in the spec's host ``python`` and ``workdir``.
- every later line is either empty (a heartbeat: the launcher is alive), ``stop``, or
  ``notice``: a stop notice (worker/preempt.py), SIGTERM to the task's program process alone,
  never to what it forked (a data loader's workers), as taskinit's NOTICE does for a local task;
  the helper then goes on watching, and the task saves and exits on its own.

`distlaunch stacks` sends another first line instead, ``{"stacks": {"run_id": "...", "task":
"worker-1", "native": true}}``: the helper finds that task's program on this host (its
environment names the run and the task), prints every thread's stack as `py-spy dump` shows it,
and exits 0 (1: no such task here, or no stacks; the reason is on stderr). Where py-spy cannot
read the program (not installed, no ptrace rights in a container), it asks the program itself:
SIGUSR2 makes the bootstrap's faulthandler append its stacks to the task's file in
RUN/stacks/signal-attempt-N/, which is printed instead. That signal goes to the program alone,
and only when that file shows the handler is in place. It starts nothing. The launcher sends this
query over SSH, as a Slurm step on the task's node, and with `docker exec` into a container.

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
carry a signal death). It imports neither launcher code nor TensorFlow: it must start fast and
work with nothing but the standard library (Linux >= 5.3 for pidfd). A Slurm job step runs this
file by path as ``PYTHON -I -S .../remote.py``, without site-packages: an import of anything
outside the standard library (distlaunch's own modules included) would break it there.
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

# Bumped whenever the request format, the agent's lines (distlaunch.host.agent, which has the
# same number) or the worker contract changes; preflight refuses a host that speaks another.
# 4: one agent per host runs every task of the host under this helper.
# 5: the agent keeps warm standbys (``prepare``), started by this helper with ``standby_fd``.
PROTOCOL = 5
STOP = b"stop"
NOTICE = b"notice"
# Exit codes for a task that could not be started, as POSIX shells use them.
EXIT_BAD_REQUEST = 125
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
# After the task's leader exits on its own, how long what it forked gets to follow a SIGTERM.
LEFTOVER_GRACE_S = 1.0
# A stacks query: how long py-spy may take (it pauses a TensorFlow process with hundreds of
# threads), and how long the program may take to write its faulthandler dump after SIGUSR2.
DUMP_TIMEOUT_S = 60.0
SIGNAL_TIMEOUT_S = 5.0
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
                return _stacks(query)
        request = _parse(line)
    except (ValueError, TypeError) as exc:
        _say(f"bad request from the launcher: {exc}")
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
        _say(f"cannot start the task: {exc}")
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
            _say(f"killing the task: {lost}")
            return self._finish(self._stop_group(0.0))
        _say(f"stopping the task: {reason}")
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
        if _signal_group(self.child.pid, 0):
            _signal_group(self.child.pid, signal.SIGTERM)
            deadline = time.monotonic() + LEFTOVER_GRACE_S
            while _signal_group(self.child.pid, 0) and time.monotonic() < deadline:
                time.sleep(0.05)
            _signal_group(self.child.pid, signal.SIGKILL)
        _sweep()
        return code

    def _stop_group(self, grace_s: float) -> int:
        """SIGTERM the task's group, wait up to ``grace_s`` for the leader, then SIGKILL the group
        (at once when ``grace_s`` is 0)."""
        if grace_s > 0:
            _signal_group(self.child.pid, signal.SIGTERM)
            try:
                self.child.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        # Also reaches what the task forked, even when the leader has already exited.
        _signal_group(self.child.pid, signal.SIGKILL)
        code = self.child.wait()
        _sweep()
        return code

    def _finish(self, code: int) -> int:
        if code < 0:
            _say(signal_death(-code))
            return 128 - code
        return code


def _sweep() -> None:
    """SIGKILL and reap every process left of the task: all are this subreaper's children by now,
    or become so when their parent is killed."""
    while True:
        children = _children(os.getpid())
        if not children:
            return
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in children:  # one by one: waiting for any would also wait for a new orphan
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


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


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


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


def _stacks(query: dict[str, Any]) -> int:
    """Print the stacks of the task ``query`` names: py-spy's dump of its program on this host, or,
    where py-spy cannot read it, the program's own faulthandler dump. Only that program is ever
    signalled, and only once its faulthandler is in place."""
    run_id, task = str(query.get("run_id", "")), str(query.get("task", ""))
    found = _program_of(run_id, task)
    if found is None:
        _say(f"no process of task {task} of run {run_id} on this host")
        return 1
    pid, env = found
    why = _spy(pid, bool(query.get("native")))
    if why is None:
        return 0
    # The file the bootstrap's faulthandler writes to (contract.stacks_signal_path), from the
    # program's own environment: on a host that does not share the run dir it is on this disk.
    file = os.path.join(
        env_value(env, b"DISTLAUNCH_RUN_DIR"),
        "stacks",
        f"signal-attempt-{int(env_value(env, b'DISTLAUNCH_ATTEMPT') or 0)}",
        f"{task}.txt",
    )
    if not env_value(env, b"DISTLAUNCH_RUN_DIR") or not os.path.isfile(file):
        # No handler in place: SIGUSR2's default action would end the program.
        _say(f"{why}; and the task has no faulthandler to ask")
        return 1
    text = _signalled(pid, file)
    if not text.strip():
        _say(f"{why}; and the task wrote no faulthandler dump within {SIGNAL_TIMEOUT_S:g} s")
        return 1
    sys.stdout.write(f"faulthandler dump (py-spy could not read the task: {why})\n\n{text}")
    return 0


def _program_of(run_id: str, task: str) -> tuple[int, set[bytes]] | None:
    """The task's program on this host and its environment: a process whose environment names
    the run and the task, preferring a process group leader (the helper starts the program as
    one; what it forks inherits the environment), never this query itself (in a container,
    `docker exec` gives it the task's environment) nor a container's init (PID 1, docker-init,
    which only passes signals on)."""
    wanted = b"DISTLAUNCH_RUN_ID=" + run_id.encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = set(f.read().split(b"\0"))
            pid = int(entry)
            leader = os.getpgid(pid) == pid
        except OSError:
            continue
        role, index = env_value(env, b"DISTLAUNCH_ROLE"), env_value(env, b"DISTLAUNCH_INDEX")
        if wanted in env and f"{role}-{index}" == task:
            found.append(((pid == 1, not leader, pid), env))
    if not found:
        return None
    key, env = min(found, key=lambda item: item[0])
    return key[2], env


def _spy(pid: int, native: bool) -> str | None:
    """Print py-spy's dump of ``pid`` (with native frames if asked and it can); None when it
    did, else why not (one line)."""
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if spy is None:
        return "py-spy is not installed on this host (pip install py-spy)"
    why = "py-spy failed"
    for with_native in (True, False) if native else (False,):
        argv = [spy, "dump", "--pid", str(pid), *(["--native"] if with_native else [])]
        try:
            done = subprocess.run(
                argv, check=False, capture_output=True, text=True, timeout=DUMP_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            why = f"py-spy took longer than {DUMP_TIMEOUT_S:g} s"
            continue
        if done.returncode == 0 and "Thread " in done.stdout:
            sys.stdout.write(done.stdout)
            return None
        errors = [x for x in done.stderr.splitlines() if x.startswith("Error:")]
        why = errors[0].removeprefix("Error:").strip() if errors else why
    return why


def _signalled(pid: int, file: str) -> str:
    """Send the program SIGUSR2 (its faulthandler appends its stacks to ``file``) and return what
    it wrote within SIGNAL_TIMEOUT_S ("" if nothing)."""
    start = os.path.getsize(file)
    try:
        os.kill(pid, signal.SIGUSR2)
    except OSError:
        return ""
    deadline, size = time.monotonic() + SIGNAL_TIMEOUT_S, start
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = os.path.getsize(file)
        if now > start and now == size:
            break  # it wrote, and has stopped writing
        size = now
    with open(file, "rb") as f:
        f.seek(start)
        return f.read().decode("utf-8", "replace")


def env_value(env: set[bytes], name: bytes) -> str:
    """The value of variable ``name`` in a set of ``NAME=value`` entries ("" when absent)."""
    prefix = name + b"="
    return next(
        (e[len(prefix) :].decode(errors="replace") for e in env if e.startswith(prefix)), ""
    )


def _say(message: str) -> None:
    try:
        sys.stderr.write(f"{_SAID}{message}\n")
        sys.stderr.flush()
    except (BrokenPipeError, OSError):
        pass  # the channel is gone: nobody is left to tell


if __name__ == "__main__":
    sys.exit(main())
