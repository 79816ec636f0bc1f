"""The agent: one process per remote host and run that starts and watches all of that host's tasks.

The launcher runs ``ssh HOST 'exec PYTHON -m distlaunch.host.agent'`` once per host (one SSH
session, however many tasks the host has) and talks to the agent over that session alone.

Each task runs under its own keeper, `remote.py` (the per-task helper: its own process group and
session, the task's CPUs, SIGTERM, grace, SIGKILL of the group, a subreaper's sweep of whatever
the task forked). A keeper is a fork of the agent that runs `remote.main` (the agent imported it
once): a fork costs about a millisecond of CPU where starting an interpreter and importing the
keeper cost 30-40 ms, for every task and every restart of every task on the host (128 tasks on
16 hosts: 4 s of CPU). The fork closes everything of the agent's but its own pipes and drops the
agent's signal handlers before the keeper's code runs; its command line reads as the keeper's
(`KEEPER_TITLE`), so `ps` on the host tells the agent from its keepers. The agent is the keepers'
parent on the host: it holds their stdin (EOF makes a keeper SIGKILL its task's group at once)
and reads their stdout (the task's output and the keeper's own lines). So when the agent dies
(killed, or its channel gone) every keeper sees EOF, and nothing of the run is left on the
host, exactly as when a per-task client died before.

The launcher's side (stdin), one line each:

- first: ``{"agent": PROTOCOL, "heartbeat_s": 20, "term_is_notice": false, "beat_s": 2}``
  (``term_is_notice``: SIGTERM is a Slurm step's stop notice, which each keeper passes to its
  program; ``beat_s``: send an ``h`` frame that often, the agent's own heartbeat); an agent of another protocol says so and
  exits with EXIT_PROTOCOL (preflight refuses such a host before anything starts);
- ``{"start": ID, "request": {...}}``: start a task; the request is `remote.py`'s first line;
- ``{"guard": REQUEST}``: be this host's firewall guard for the run (`distlaunch.host.guard`'s
  request line: the run's task ports here admit the run's hosts only). The agent installs the
  rules and answers a ``g`` frame (task 0) with the guard's answer line; the rules stay until
  the agent ends, however it ends (EOF, the heartbeat's silence, a signal) but SIGKILL, and go
  once its tasks are gone (their ports closed, or LINGER_S). So a host has one distlaunch
  process for the run, not an agent beside a guard;
- ``{"stop": ID}``, ``{"notice": ID}``: passed to that task's keeper as its ``stop`` and
  ``notice`` lines; ``{"kill": ID}``: close the keeper's stdin (SIGKILL of the task at once);
- ``{"prepare": ID, "request": {...}, "writes": [[op, name, value], ...]}``: start a warm standby
  (launcher/transports/agent_standby.py): the request's command (a bootstrap's) under a keeper,
  with DISTLAUNCH_STANDBY naming its control socket and ``writes`` (launcher/host/bootstrap.py): it
  imports TensorFlow and waits. Its output is held here, not sent, until it becomes a task;
- ``{"start": ID, "request": {...}, "standby": SID}``: the standby SID becomes task ID (its held
  output is sent as ID's, then it is told to go); one that has died starts ID cold from the
  request; ``{"discard": SID}``: kill an unused standby (its keeper's EOF: SIGKILL of its group);
- an empty line: a heartbeat. EOF, or no line for ``heartbeat_s``: every task is killed at once
  and the agent exits.

The agent's side (stdout), frames (`frame`): ``o`` a chunk of the task's output, ``s`` the task
has started (its keeper's pid), ``x`` the task ended (the keeper's
exit code: the task's, 128+N for signal N), sent after the last of its output; ``h`` (task 0):
the agent lives; ``g`` (task 0): the answer to ``guard``; ``r`` a standby has imported TensorFlow
(it is ready). A standby's ``s`` and ``x`` carry its own ID until it becomes a task.

SIGTERM (unless it is a notice), SIGHUP or SIGINT to the agent stops every task (its keeper's stop: TERM, grace, KILL).
It imports neither launcher code nor anything outside the standard library (`guard`, standard
library only too, is imported when a ``guard`` line comes: by path, from beside this file,
where the agent runs by path without the package, as a Slurm step does).
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import selectors
import signal
import socket
import sys
import time
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distlaunch.host import guard

# remote.PROTOCOL, which this file cannot import when run by path: bumped together whenever these
# lines or frames or the keeper's request change; preflight refuses a host that speaks another.
PROTOCOL = 5
EXIT_PROTOCOL = 3
# Where this file's siblings (remote.py, each task's keeper; guard.py) are loaded from by path
# when the agent runs by path, without its package (`_sibling`).
HERE = os.path.dirname(os.path.abspath(__file__))
# What a keeper's command line reads on the host (as much of it as the agent's own has room for).
KEEPER_TITLE = "distlaunch.host.remote: keeper of task %d"
# After a keeper exits, how long its output pipe may stay open (a process it failed to end).
DRAIN_S = 1.0
# How long the agent waits for its keepers to end their tasks before it exits anyway.
END_WAIT_S = 60.0
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
# bootstrap.STANDBY_ENV, READY and GO, which this file cannot import when run by path.
_STANDBY_ENV = "DISTLAUNCH_STANDBY"
_READY, _GO = b"r", b"g"
# The most of a standby's output (its imports' warnings) held for the task it may become.
HELD_MAX = 1 << 20


def frame(kind: bytes, task: int, payload: bytes) -> bytes:
    """One frame of the agent's output: ``KIND ID LENGTH\\n``, the payload, ``\\n``. The last
    newline is not data: srun forwards a step's output a line at a time, so a frame that did not
    end a line would wait in srun until the next one."""
    return b"%s %d %d\n" % (kind, task, len(payload)) + payload + b"\n"


class _Keeper:
    """One task's keeper process (a fork of the agent, `_fork_keeper`), its pipes and what is
    known of its end."""

    def __init__(self, task: int, request: dict, pass_fds: tuple[int, ...] = ()) -> None:
        self.task = task
        # Its own GPUs of the step's (a Slurm node's, gpu_share.py); NoShare is an OSError.
        request = _sibling("gpu_share").with_share(request, os.environ)
        self.pid, stdin, self.out = _fork_keeper(task, pass_fds)
        self.stdin = os.fdopen(stdin, "wb")
        os.set_blocking(self.out, False)
        self.pidfd = os.pidfd_open(self.pid)
        self.out_open = True
        self.exited_at: float | None = None
        self.code: int | None = None
        # Its heartbeat is this pipe staying open: the agent watches the launcher's.
        self.send(json.dumps({**request, "heartbeat_s": None}).encode())

    def send(self, line: bytes) -> None:
        """Write one line to the keeper; one that has exited no longer reads."""
        if self.stdin.closed:
            return
        try:
            self.stdin.write(line + b"\n")
            self.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def close_out(self, sel: selectors.BaseSelector) -> None:
        """Stop reading the keeper's output (its end, or it has had DRAIN_S since its exit)."""
        self.out_open = False
        sel.unregister(self.out)
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


class _StandbyKeeper(_Keeper):
    """A warm standby: a keeper whose task is held at the bootstrap's door until `go`, its output
    held here until then (HELD_MAX at most: beyond that it is dropped, and says so)."""

    def __init__(self, task: int, request: dict, writes: list) -> None:
        ours, theirs = socket.socketpair()  # both close-on-exec: the keeper gets its end alone
        order = {"fd": theirs.fileno(), "env": writes}
        request = {
            **request,
            "env": {**request.get("env", {}), _STANDBY_ENV: json.dumps(order)},
            "standby_fd": theirs.fileno(),
        }
        try:
            super().__init__(task, request, pass_fds=(theirs.fileno(),))
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self.control: socket.socket | None = ours
        self.held: bytearray | None = bytearray()  # None once it is a task

    def hold(self, chunk: bytes) -> bool:
        """Keep a chunk of a standby's output; False once it is a task (send it)."""
        if self.held is None:
            return False
        if len(self.held) < HELD_MAX:
            self.held += chunk[: HELD_MAX - len(self.held)]
            if len(self.held) == HELD_MAX:
                self.held += b"\ndistlaunch agent: the standby's further output was dropped\n"
        return True

    def go(self) -> bool:
        """Tell the standby to go (it becomes the task); False when it cannot hear it."""
        if self.control is None:
            return False
        try:
            self.control.sendall(_GO)
        except OSError:
            return False
        return True


def _sibling(name: str) -> ModuleType:
    """This package's module ``name`` (``remote``, ``guard``): imported, or loaded by path from
    beside this file where the agent runs by path without site-packages (a Slurm step), so that
    it cannot import its own package. Once: later calls get the same module."""
    try:
        return importlib.import_module(f"distlaunch.host.{name}")
    except ImportError:
        pass
    key = f"distlaunch_host_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(HERE, f"{name}.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # before it runs: dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[key]


def _fork_keeper(task: int, pass_fds: tuple[int, ...]) -> tuple[int, int, int]:
    """Fork the keeper of ``task``: its pid, the write end of its stdin and the read end of its
    output (stdout and stderr). The child keeps its pipes as 0, 1 and 2 and ``pass_fds`` under
    their numbers, and nothing else of the agent's; it runs `remote.main` and exits with its
    code. The agent starts no thread, so the fork copies a process that is whole."""
    keeper = _sibling("remote")  # imported by the agent: every fork has it
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
            code = _be_keeper(keeper, task, stdin_r, out_w, pass_fds)
        finally:
            os._exit(code)
    os.close(stdin_r)
    os.close(out_w)
    return pid, stdin_w, out_r


def _be_keeper(
    keeper: ModuleType, task: int, stdin: int, out: int, pass_fds: tuple[int, ...]
) -> int:
    """In the forked child: become the keeper of ``task`` (see `_fork_keeper`)."""
    signal.set_wakeup_fd(-1)
    for sig in _STOP_SIGNALS:
        # The agent's handlers go; an ignored SIGTERM (a Slurm step's notice) stays ignored, as
        # it did across the exec of a keeper, until the keeper's own handler takes it.
        if callable(signal.getsignal(sig)):
            signal.signal(sig, signal.SIG_DFL)
    os.dup2(stdin, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    keep = sorted({2, *pass_fds})
    for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")]):
        os.closerange(low + 1, high)
    # Fresh streams over the new 0, 1 and 2: the agent's own may hold buffered bytes of its
    # channel, which must not come out here.
    sys.stdin = open(0, "rb", closefd=False)  # noqa: SIM115 (the keeper's, for its life)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    _retitle((KEEPER_TITLE % task).encode())
    try:
        return keeper.main()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except OSError:
                pass


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


class Agent:
    """The select loop: the launcher's lines, the keepers' output and exits, stop signals."""

    def __init__(
        self, heartbeat_s: float | None, term_is_notice: bool = False, beat_s: float | None = None
    ) -> None:
        self.heartbeat_s = heartbeat_s
        self.beat_s = beat_s
        self.keepers: dict[int, _Keeper] = {}
        self.sel = selectors.DefaultSelector()
        self.out = sys.stdout.buffer
        self._buffer = b""
        self._signalled = False
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        for sig in _STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        if term_is_notice:
            # A Slurm step's SIGTERM reaches every process of it, the keepers too: each passes
            # it to its task's program as a stop notice, and the agent carries on.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.set_wakeup_fd(wake_w)
        self.sel.register(wake_r, selectors.EVENT_READ, ("signal", None))
        self.sel.register(0, selectors.EVENT_READ, ("launcher", None))
        self.guarded: tuple[guard.Request, guard.Installed] | None = None  # the rules it holds

    def run(self, pending: bytes) -> int:
        """Serve the launcher until its channel ends; return 0 (or 1 when it was lost)."""
        self._buffer = pending
        self._lines([])
        last_heard = next_beat = time.monotonic()
        while True:
            if self.beat_s is not None and time.monotonic() >= next_beat:
                # The launcher's side of a cut link learns of it from this silence, sooner than
                # from TCP or ssh's keepalives.
                self._emit(b"h", 0, b"")
                next_beat = time.monotonic() + self.beat_s
            timeout = DRAIN_S / 4 if self._draining() else None
            for deadline in (
                last_heard + self.heartbeat_s if self.heartbeat_s is not None else None,
                next_beat if self.beat_s is not None else None,
            ):
                if deadline is not None:
                    left = max(0.0, deadline - time.monotonic())
                    timeout = left if timeout is None else min(timeout, left)
            for key, _ in self.sel.select(timeout):
                kind, keeper = key.data
                if kind == "launcher":
                    chunk = os.read(0, 65536)
                    if not chunk:
                        return self._end(kill=True)
                    last_heard = time.monotonic()
                    self._lines([chunk])
                elif kind == "signal":
                    try:
                        os.read(key.fd, 512)
                    except BlockingIOError:
                        pass
                    if self._signalled:
                        return self._end(kill=False)
                elif kind == "out":
                    self._read_output(keeper)
                elif kind == "control":
                    self._standby_said(keeper)
                elif kind == "exit":
                    keeper.exited_at = time.monotonic()
                    self.sel.unregister(keeper.pidfd)
            self._report_ends()
            if self.heartbeat_s is not None and time.monotonic() - last_heard > self.heartbeat_s:
                return self._end(kill=True)

    def _lines(self, chunks: list[bytes]) -> None:
        self._buffer += b"".join(chunks)
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            if line.strip():
                self._command(json.loads(line))

    def _command(self, command: dict) -> None:
        if "guard" in command:
            self._emit(b"g", 0, json.dumps(self._guard(command["guard"])).encode())
            return
        if "prepare" in command or "discard" in command or "standby" in command:
            self._standby_command(command)
            return
        if "start" in command:
            task = int(command["start"])
            try:
                keeper = _Keeper(task, command["request"])
            except OSError as exc:
                self._emit(b"o", task, f"agent: cannot start the task's keeper: {exc}\n".encode())
                self._emit(b"x", task, b"126")
                return
            self.keepers[task] = keeper
            self.sel.register(keeper.out, selectors.EVENT_READ, ("out", keeper))
            self.sel.register(keeper.pidfd, selectors.EVENT_READ, ("exit", keeper))
            self._emit(b"s", task, str(keeper.pid).encode())
            return
        for word in ("stop", "notice"):
            if word in command and int(command[word]) in self.keepers:
                self.keepers[int(command[word])].send(word.encode())
        if "kill" in command and int(command["kill"]) in self.keepers:
            self.keepers[int(command["kill"])].close_stdin()

    def _standby_command(self, command: dict) -> None:
        """``prepare``, ``discard`` and a ``start`` that names a standby (the module docstring)."""
        if "prepare" in command:
            number = int(command["prepare"])
            try:
                standby = _StandbyKeeper(number, command["request"], command.get("writes") or [])
            except OSError:
                self._emit(b"x", number, b"126")  # no standby: that task restarts cold
                return
            self._watch(standby)
            self.sel.register(standby.control, selectors.EVENT_READ, ("control", standby))
            self._emit(b"s", number, str(standby.pid).encode())
            return
        if "discard" in command:
            standby = self.keepers.get(int(command["discard"]))
            if isinstance(standby, _StandbyKeeper) and standby.held is not None:
                self._release(standby)
                standby.close_stdin()
            return
        task, used = int(command["start"]), int(command["standby"])
        standby = self.keepers.get(used)
        if not (
            isinstance(standby, _StandbyKeeper)
            and standby.held is not None
            and standby.exited_at is None
            and standby.go()
        ):
            # It died unused (its end is on its way, under its own ID): a cold start.
            self._command({"start": task, "request": command["request"]})
            return
        self._release(standby)
        del self.keepers[used]
        standby.task = task
        self.keepers[task] = standby
        self._emit(b"s", task, str(standby.pid).encode())
        held, standby.held = bytes(standby.held), None
        if held:
            self._emit(b"o", task, held)

    def _watch(self, keeper: _Keeper) -> None:
        self.keepers[keeper.task] = keeper
        self.sel.register(keeper.out, selectors.EVENT_READ, ("out", keeper))
        self.sel.register(keeper.pidfd, selectors.EVENT_READ, ("exit", keeper))

    def _standby_said(self, standby: _StandbyKeeper) -> None:
        """The standby's control socket is readable: ``r`` (ready) or EOF (it died)."""
        try:
            said = standby.control.recv(1) if standby.control is not None else b""
        except OSError:
            said = b""
        if said == _READY and standby.held is not None:
            self._emit(b"r", standby.task, b"")
        if said != _READY:
            self._release(standby)

    def _release(self, standby: _StandbyKeeper) -> None:
        """Stop watching the standby's control socket and close it (the standby reads EOF)."""
        if standby.control is not None:
            self.sel.unregister(standby.control)
            standby.control.close()
            standby.control = None

    def _read_output(self, keeper: _Keeper) -> None:
        try:
            chunk = os.read(keeper.out, 65536)
        except BlockingIOError:
            return
        if chunk:
            if isinstance(keeper, _StandbyKeeper) and keeper.hold(chunk):
                return
            self._emit(b"o", keeper.task, chunk)
            return
        keeper.close_out(self.sel)

    def _draining(self) -> bool:
        return any(k.exited_at is not None and k.out_open for k in self.keepers.values())

    def _report_ends(self) -> None:
        """Say ``x`` for each keeper that has exited and whose output is all sent (or has had
        DRAIN_S to be)."""
        now = time.monotonic()
        for keeper in list(self.keepers.values()):
            if keeper.exited_at is None:
                continue
            if keeper.out_open and now - keeper.exited_at < DRAIN_S:
                continue
            if keeper.out_open:
                keeper.close_out(self.sel)
            code = keeper.wait()
            assert code is not None  # its pidfd said it has exited
            os.close(keeper.pidfd)
            keeper.close_stdin()
            del self.keepers[keeper.task]
            self._emit(b"x", keeper.task, str(code if code >= 0 else 128 - code).encode())

    def _end(self, kill: bool) -> int:
        """End every task (at once, or by each keeper's stop) and wait for the keepers."""
        for keeper in self.keepers.values():
            if kill:
                keeper.close_stdin()
            else:
                keeper.send(b"stop")
        deadline = time.monotonic() + END_WAIT_S
        for keeper in self.keepers.values():
            if keeper.wait(timeout=max(0.0, deadline - time.monotonic())) is None:
                keeper.kill()
                keeper.wait()
        return 1 if kill else 0

    def _guard(self, line: object) -> dict:
        """Install the run's rules on this host (`distlaunch.host.guard`'s request ``line``);
        the guard's answer. Signals are trapped already: one that comes now still ends in
        `unguard`."""
        guard = _sibling("guard")
        if self.guarded is not None:
            return {"protected": False, "why": "this agent guards the run already"}
        try:
            request = guard.parse(json.dumps(line).encode())
        except (ValueError, TypeError) as exc:
            return {"protected": False, "why": f"bad request from the launcher: {exc}"}
        allowed = guard.resolve(request)
        try:
            installed = guard.install(request, allowed)
        except guard.Unprotected as exc:
            return {"protected": False, "why": str(exc)}
        self.guarded = (request, installed)
        return {
            "protected": True,
            "how": installed.how,
            "table": installed.name,
            "allowed": allowed,
        }

    def unguard(self, why: str) -> None:
        """Remove the run's rules (if this agent holds some) once no task port listens here any
        more (at most the guard's LINGER_S): the tasks are gone first."""
        if self.guarded is None:
            return
        guard = _sibling("guard")
        request, installed = self.guarded
        self.guarded = None
        deadline = time.monotonic() + guard.LINGER_S
        while guard.listening(request.ports) and time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            sys.stderr.write(
                f"distlaunch agent: {why}: removing the {installed.how} rules {installed.name} "
                f"of run {request.run_id}\n"
            )
            sys.stderr.flush()
        except (BrokenPipeError, OSError):
            pass
        installed.remove()

    def _emit(self, kind: bytes, task: int, payload: bytes) -> None:
        try:
            self.out.write(frame(kind, task, payload))
            self.out.flush()
        except (BrokenPipeError, OSError):
            pass  # the channel is gone: EOF on stdin follows and ends everything

    def _on_signal(self, _signum: int, _frame: object) -> None:
        self._signalled = True


def main() -> int:
    """Read the hello line, then serve the launcher (see the module docstring)."""
    buffer = b""
    while b"\n" not in buffer:
        chunk = os.read(0, 65536)
        if not chunk:
            return 1
        buffer += chunk
    line, _, rest = buffer.partition(b"\n")
    try:
        hello = json.loads(line)
        wanted = int(hello["agent"])
        heartbeat_s = float(hello["heartbeat_s"]) if hello.get("heartbeat_s") else None
        term_is_notice = bool(hello.get("term_is_notice"))
        beat_s = float(hello["beat_s"]) if hello.get("beat_s") else None
    except (ValueError, TypeError, KeyError) as exc:
        sys.stderr.write(f"distlaunch agent: bad first line from the launcher: {exc}\n")
        return EXIT_PROTOCOL
    if wanted != PROTOCOL:
        sys.stderr.write(
            f"distlaunch agent: this host's distlaunch speaks agent protocol {PROTOCOL}, "
            f"the launcher {wanted}; install the same distlaunch version on every host\n"
        )
        return EXIT_PROTOCOL
    _sibling("remote")  # the keepers' code, now, before any task waits for it
    served = Agent(heartbeat_s, term_is_notice, beat_s)
    code = 1
    try:
        code = served.run(rest)
    finally:
        served.unguard("the launcher's channel ended" if code else "the agent was stopped")
    return code


if __name__ == "__main__":
    sys.exit(main())
