"""The agent: one process per remote host and run that starts and watches all of that host's tasks.

The launcher runs ``ssh HOST 'exec PYTHON -m distlaunch.host.agent'`` once per host (one SSH
session, however many tasks the host has) and talks to the agent over that session alone. Its
jobs, one module each: the channel (`channel`: frames out without ever blocking, typed commands
in), the tasks (`keepers`: each task under a keeper, a fork of the agent running `remote.main`),
the warm standbys (`standbys`) and the host's firewall (`wall`, installed off the loop). This
module is the loop that ties them: one select over the launcher's stdin, the keepers' output,
exits and control sockets, the firewall's install, the channel's room to write, and signals.

The launcher's side (stdin), one line each:

- first: ``{"agent": PROTOCOL, "heartbeat_s": 20, "term_is_notice": false, "beat_s": 2}``
  (``term_is_notice``: SIGTERM is a Slurm step's stop notice, which each keeper passes to its
  program; ``beat_s``: send an ``h`` frame that often); the agent answers its hello frame
  (`channel.hello`). An agent of another protocol says so on stderr and exits with
  EXIT_PROTOCOL (preflight refuses such a host before anything starts);
- then commands, ``{"v": PROTOCOL, "op": OP, "id": ID, ...}`` (`channel.parse_command`):
  ``start`` (``request``: `remote.py`'s first line; ``standby``: the standby that becomes it),
  ``stop`` and ``notice`` (passed to the keeper), ``kill`` (the keeper's EOF: SIGKILL of the
  task at once), ``prepare`` (a warm standby: ``request``, ``writes``), ``discard``, and
  ``guard`` (``request``: `distlaunch.host.guard`'s: be this host's firewall for the run). A line
  that is none of these is answered with an ``e`` frame (``{"error": ..., "id": ...}``) and ends
  nothing;
- an empty line: a heartbeat. EOF, or no line for ``heartbeat_s``: every task is killed at once
  and the agent exits.

The agent's side (stdout), frames after the hello: ``o`` a chunk of the task's output, ``s`` it
started (its keeper's pid; ``PID warm`` when a standby became it), ``x`` it ended (the keeper's
exit code: the task's, 128+N for signal N), after the last of its output; ``h`` (0): the agent
lives; ``g`` (0): the firewall's answer; ``r`` a standby is ready; ``e`` a command was refused.

While the firewall installs, starts wait for it; where it cannot be installed and the request
says ``required``, they are refused (``x`` 126 with the reason as output): a host of a run that
requires protection runs nothing unprotected, a restarted agent's included. The rules stay until
the agent ends, however it ends (EOF, the heartbeat's silence, a signal) but SIGKILL, and go
once its tasks' ports have closed (or LINGER_S).

SIGTERM (unless it is a notice), SIGHUP or SIGINT stops every task (its keeper's stop: TERM,
grace, KILL). It imports nothing outside the standard library and its own package; where it runs
by path without site-packages (a Slurm step), its package is this folder (`remote.package_here`).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import sys
import time

if not __package__:  # run by path, without site-packages: its package is this folder
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import remote  # type: ignore[import-not-found]  # noqa: F401 (its import does it)

    del sys.path[0]

from distlaunch.host import channel, keepers, standbys, timeouts  # noqa: E402
from distlaunch.host.channel import PROTOCOL, BadCommand, Command  # noqa: E402
from distlaunch.host.keepers import Keeper  # noqa: E402

EXIT_PROTOCOL = 3
_STOP_SIGNALS = keepers.STOP_SIGNALS


class Agent:
    """The select loop: the launcher's lines, the keepers' output and exits, the firewall, stop
    signals, and the channel's room to write."""

    def __init__(
        self, heartbeat_s: float | None, term_is_notice: bool = False, beat_s: float | None = None
    ) -> None:
        self.heartbeat_s = heartbeat_s
        self.beat_s = beat_s
        self.keepers: dict[int, Keeper] = {}
        self.sel = selectors.DefaultSelector()
        self.outbox = channel.Outbox(sys.stdout.fileno())
        self._writing = False  # the channel's fd is watched for room
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
        self.firewall = None  # the host's firewall job once a `guard` came (`_Firewall`)

    def run(self, pending: bytes) -> int:
        """Serve the launcher until its channel ends; return 0 (or 1 when it was lost)."""
        self.emit_hello()
        self._lines(pending)
        last_heard = next_beat = time.monotonic()
        while True:
            now = time.monotonic()
            if self.beat_s is not None and now >= next_beat:
                # The launcher's side of a cut link learns of it from this silence, sooner than
                # from TCP or ssh's keepalives.
                self.emit(b"h", 0, b"")
                next_beat = now + self.beat_s
            deadlines = [
                last_heard + self.heartbeat_s if self.heartbeat_s is not None else None,
                next_beat if self.beat_s is not None else None,
                now + timeouts.DRAIN_S / 4 if self._draining() else None,
                self.firewall.deadline() if self.firewall is not None else None,
            ]
            timeout = min((max(0.0, d - now) for d in deadlines if d is not None), default=None)
            for key, _ in self.sel.select(timeout):
                kind, keeper = key.data
                if kind == "launcher":
                    chunk = os.read(0, 65536)
                    if not chunk:
                        return self._end(kill=True)
                    last_heard = time.monotonic()
                    self._lines(chunk)
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
                    standbys.said(self, keeper)
                elif kind == "exit":
                    keeper.exited_at = time.monotonic()
                    self.sel.unregister(keeper.pidfd)
                elif kind == "firewall":
                    self.firewall.answered()
                elif kind == "room":
                    self.outbox.flush()
            if self.firewall is not None:
                self.firewall.check_deadline()
            self._report_ends()
            self._pace()
            if self.heartbeat_s is not None and time.monotonic() - last_heard > self.heartbeat_s:
                return self._end(kill=True)

    # ---- the channel ---------------------------------------------------------------------

    def emit_hello(self) -> None:
        """The first frame: the magic and this protocol's number."""
        self.outbox.put(channel.hello())

    def emit(self, kind: bytes, task: int, payload: bytes) -> None:
        """Queue one frame (written as the channel takes it, never waiting)."""
        self.outbox.put(channel.frame(kind, task, payload))

    def _pace(self) -> None:
        """Watch the channel for room while frames wait, and read task output only while the
        outbox has room for it."""
        waiting = self.outbox.waiting()
        if waiting != self._writing:
            if waiting:
                self.sel.register(self.outbox.fd, selectors.EVENT_WRITE, ("room", None))
            else:
                self.sel.unregister(self.outbox.fd)
            self._writing = waiting
        room = not self.outbox.full()
        for keeper in self.keepers.values():
            keeper.read_output(self.sel, room)

    def _lines(self, chunk: bytes) -> None:
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            if not line.strip():
                continue  # a heartbeat
            try:
                self.command(channel.parse_command(line))
            except BadCommand as exc:
                self._refuse(line, str(exc))
            except Exception as exc:  # noqa: BLE001 - a command that fails ends nothing
                self._refuse(line, f"{type(exc).__name__}: {exc}")

    def _refuse(self, line: bytes, why: str) -> None:
        """An ``e`` frame: the command is refused; nothing else changes."""
        try:
            number = json.loads(line).get("id", 0)
        except (ValueError, AttributeError, RecursionError):
            number = 0
        number = number if type(number) is int and number >= 0 else 0
        answer = {"error": why, "id": number, "line": line[:200].decode(errors="replace")}
        self.emit(b"e", 0, json.dumps(answer).encode())

    # ---- the tasks -----------------------------------------------------------------------

    def command(self, command: Command) -> None:
        """Carry out one command from the launcher (or one the firewall held until now)."""
        if command.op == "guard":
            self._guard(command.request)
            return
        if command.op in ("start", "prepare") and self.firewall is not None:
            if self.firewall.hold(command):
                return
        if command.op == "prepare":
            standbys.prepare(self, command)
        elif command.op == "discard":
            standbys.discard(self, command)
        elif command.op == "start" and command.standby is not None:
            standbys.become(self, command)
        elif command.op == "start":
            self.start_cold(command.id, command.request)
        elif command.id in self.keepers:
            keeper = self.keepers[command.id]
            if command.op == "kill":
                keeper.close_stdin()
            else:
                keeper.send(command.op.encode())  # stop, notice

    def start_cold(self, task: int, request: dict) -> None:
        """Start ``task`` under a keeper of its own (its ``s`` frame, or its ``x`` with why not)."""
        try:
            keeper = Keeper(task, request)
        except OSError as exc:
            self.emit(b"o", task, f"agent: cannot start the task's keeper: {exc}\n".encode())
            self.emit(b"x", task, b"126")
            return
        self.watch(keeper)
        self.emit(b"s", task, str(keeper.pid).encode())

    def watch(self, keeper: Keeper) -> None:
        """Read the keeper's output and learn of its exit."""
        self.keepers[keeper.task] = keeper
        keeper.read_output(self.sel, True)
        self.sel.register(keeper.pidfd, selectors.EVENT_READ, ("exit", keeper))

    def _read_output(self, keeper: Keeper) -> None:
        try:
            chunk = os.read(keeper.out, 65536)
        except BlockingIOError:
            return
        if chunk:
            if isinstance(keeper, standbys.StandbyKeeper) and keeper.hold(chunk):
                return
            self.emit(b"o", keeper.task, chunk)
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
            if keeper.out_open and not keeper.reading:
                # Its output waits on a full channel: its end waits too (the order holds).
                keeper.exited_at = now
                continue
            if keeper.out_open and now - keeper.exited_at < timeouts.DRAIN_S:
                continue
            if keeper.out_open:
                keeper.close_out(self.sel)
            code = keeper.wait()
            assert code is not None  # its pidfd said it has exited
            os.close(keeper.pidfd)
            keeper.close_stdin()
            del self.keepers[keeper.task]
            self.emit(b"x", keeper.task, str(code if code >= 0 else 128 - code).encode())

    def _end(self, kill: bool) -> int:
        """End every task (at once, or by each keeper's stop) and wait for the keepers."""
        for keeper in self.keepers.values():
            if kill:
                # From here on this loop forwards no output: the read end goes first, so that a
                # keeper's last words ("killing the task") on a channel the launcher stopped
                # reading fail at once instead of blocking it, its task's group unkilled, until
                # END_WAIT_S and a SIGKILL that skips its sweep of what the task forked.
                if keeper.out_open:
                    keeper.close_out(self.sel)
                keeper.close_stdin()
            else:
                keeper.send(b"stop")
        deadline = time.monotonic() + timeouts.END_WAIT_S
        for keeper in self.keepers.values():
            if keeper.wait(timeout=max(0.0, deadline - time.monotonic())) is None:
                keeper.kill()
                keeper.wait()
        return 1 if kill else 0

    # ---- the firewall --------------------------------------------------------------------

    def _guard(self, request: dict) -> None:
        """Be this host's firewall guard (`wall`): the install starts now, its answer comes as
        a ``g`` frame when it is done."""
        if self.firewall is not None:
            answer = {"protected": False, "why": "this agent guards the run already"}
            self.emit(b"g", 0, json.dumps(answer).encode())
            return
        from distlaunch.host import wall  # only where the run has a firewall

        self.firewall = wall.Job(self, request)

    def unguard(self, why: str) -> None:
        """Remove the run's rules (if this agent holds some) once no task port listens here any
        more (at most LINGER_S): the tasks are gone first."""
        if self.firewall is not None:
            self.firewall.end(why)

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
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        sys.stderr.write(f"distlaunch agent: bad first line from the launcher: {exc}\n")
        return EXIT_PROTOCOL
    if wanted != PROTOCOL:
        sys.stderr.write(
            f"distlaunch agent: this host's distlaunch speaks agent protocol {PROTOCOL}, "
            f"the launcher {wanted}; install the same distlaunch version on every host\n"
        )
        return EXIT_PROTOCOL
    served = Agent(heartbeat_s, term_is_notice, beat_s)
    code = 1
    try:
        code = served.run(rest)
    finally:
        served.unguard("the launcher's channel ended" if code else "the agent was stopped")
    return code


if __name__ == "__main__":
    sys.exit(main())
