"""One machine's agent as the launcher holds it (launcher/transports/agent.py has the whole
picture): `AgentLink` is the agent's local client and its channel, `AgentHandle` one task it runs.

Nothing a host sends is trusted (launcher/transports/agent_frames.py reads it): a login shell's
words before the agent's hello are the host's, shown in its tasks' logs; an unreadable frame, a
host that never says hello and an agent gone silent end that machine's agent alone, named, and
each of its tasks with LOST_EXIT and a line in its log.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from distlaunch.host import channel
from distlaunch.host.timeouts import (
    AGENT_SILENCE_S,
    CLOSE_WAIT_S,
    HEARTBEAT_S,
    HEARTBEAT_TIMEOUT_S,
    HELLO_S,
)
from distlaunch.launcher.plan.plan import TaskPlan
from distlaunch.launcher.record import rundir
from distlaunch.launcher.transports import procs
from distlaunch.launcher.transports.agent_frames import BANNER_MAX, Frame, FrameReader, Unreadable
from distlaunch.launcher.transports.helper import JOIN_CONNECT_TIMEOUT_S, relayed_status

# A task whose agent's channel ended ends with this code, as a task whose ssh client failed did.
LOST_EXIT = 255


@dataclass(frozen=True)
class AgentCommand:
    """How one machine's agent is started: the local client's command line, what is added to
    the launcher's environment for it, how the machine is named in messages, and the signal the
    client gets when the launcher dies (None: none, it outlives the launcher to pass the EOF of
    its stdin on: `procs.spawn_client`)."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    target: str
    death_signal: signal.Signals | None = signal.SIGKILL


class StandbyFrames(Protocol):
    """What the agent says of one of its standbys (launcher/transports/agent_standby.py)."""

    def frame(self, kind: bytes, payload: bytes) -> None:
        """A frame: ``s`` its keeper's pid, ``r`` ready, ``x`` it ended (the hub's thread)."""


class AgentHandle:
    """One task run by a machine's agent (a `transports.base.TaskHandle`)."""

    def __init__(self, task: TaskPlan, link: AgentLink, number: int, warm: bool = False) -> None:
        self.task = task
        # The agent's warm standby became it: asked for here, and confirmed by the agent's ``s``
        # frame (``PID warm``), which says cold where the standby had died (`AgentTransport.start`).
        self.warm = warm
        self.started = threading.Event()  # the agent's ``s`` frame came (or the channel ended)
        self.link = link
        self.number = number  # the task's id on the channel
        self.code: int | None = None
        rundir.create_file(task.log_file)
        self._log: int | None = os.open(task.log_file, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self._ended_r, self._ended_w = os.pipe2(os.O_CLOEXEC)

    @property
    def pid(self) -> int:
        """The local client that stands for the task (and its machine's other tasks)."""
        return self.link.proc.pid

    @property
    def exit_fd(self) -> int:
        """Readable once the agent has reported the task's end (or its channel ended)."""
        return self._ended_r

    def exit_status(self) -> int | None:
        """The task's exit code as its keeper relayed it, with a death by SIGTERM as -15
        (`helper.relayed_status`); LOST_EXIT when the channel ended under it."""
        return relayed_status(self.code, self.task.log_file)

    def joined(self) -> bool:
        """Whether the task's TensorFlow server accepts connections on host:port (a TCP connect
        from the launcher, as for any remote task)."""
        try:
            with socket.create_connection(
                (self.task.host, self.task.port), timeout=JOIN_CONNECT_TIMEOUT_S
            ):
                return True
        except OSError:
            return False

    def output(self, data: bytes) -> None:
        """Append a chunk of the task's output to its log (the hub's thread); OSError (a full
        disk) is the caller's: the hub ends the machine's agent with it, naming the machine."""
        if self._log is not None:
            os.write(self._log, data)

    def say(self, line: str) -> None:
        """A line of the launcher's own in the task's log; a log that cannot be written (the
        disk is full) loses it, and nothing else."""
        try:
            self.output(line.encode())
        except OSError:
            pass

    def end(self, code: int) -> None:
        """The task has ended with ``code``: close its log and wake the supervisor (once)."""
        if self.code is not None:
            return
        self.code = code
        self.started.set()
        if self._log is not None:
            os.close(self._log)
            self._log = None
        os.write(self._ended_w, b"x")

    def close(self) -> None:
        """Release the descriptors (safe to call more than once; the task has ended)."""
        with self.link.lock:
            if self._log is not None:
                os.close(self._log)
                self._log = None
            for fd in (self._ended_r, self._ended_w):
                if fd >= 0:
                    os.close(fd)
            self._ended_r = self._ended_w = -1


class AgentLink:
    """One machine's agent: its client process, the channel and the tasks it runs.

    Nothing the channel carries is trusted: what the host says before the agent's hello (a login
    shell's words) is kept and shown in the machine's task logs, never read as frames; a host that
    talks without the hello for HELLO_S, or says more than BANNER_MAX, ends; after the hello, an
    unreadable frame ends the agent (`fail`), naming the machine, as a lost channel does. The
    other machines' agents go on.
    """

    def __init__(self, command: AgentCommand, term_is_notice: bool = False) -> None:
        self.target = command.target
        self.proc = procs.spawn_client(
            command.argv, command.env, os.getcwd(), death_signal=command.death_signal
        )
        assert self.proc.stdin and self.proc.stdout and self.proc.stderr
        self.out = self.proc.stdout.fileno()
        self.err = self.proc.stderr.fileno()
        self.lock = threading.Lock()  # the tasks and their ends (the hub writes, `start` adds)
        self._send_lock = threading.Lock()
        self.tasks: dict[int, AgentHandle] = {}
        # The warm standbys the agent keeps for this machine (launcher/transports/agent_standby.py)
        self.standbys: dict[int, StandbyFrames] = {}
        self.lost: str | None = None
        self.reader = FrameReader()
        self._err_tail = b""
        # What ends the client when its agent falls silent: a client that outlives the launcher
        # (srun) is SIGKILLed, which leaves its step to the agent's own end (EOF, or heartbeat).
        self.end_signal = command.death_signal or signal.SIGKILL
        # When the agent last said anything (None: not yet; a Slurm step may wait for its CPUs).
        self.heard: float | None = None
        self.first_words: float | None = None  # when the host first said anything
        self._why: str | None = None  # why the hub ended the client, if it did
        # The agent's answer to `guard` (None: none yet), and an event set when it comes (or the
        # channel ends without one); `required`: a host that cannot be firewalled is lost.
        self.guard_answer: dict | None = None
        self.guard_answered = threading.Event()
        self.guard_required = False
        self.refusals: list[dict] = []  # the agent's ``e`` frames (commands it refused)
        hello = {
            "op": "hello",
            "agent": channel.PROTOCOL,
            "heartbeat_s": HEARTBEAT_TIMEOUT_S,
            "term_is_notice": term_is_notice,
            "beat_s": HEARTBEAT_S,
        }
        self._write(json.dumps(hello).encode() + b"\n")

    def send(self, op: str, number: int = 0, **fields: object) -> None:
        """One command to the agent (`channel.command`)."""
        self._write(channel.command(op, number, **fields))

    def _write(self, line: bytes) -> None:
        """Write a line to the agent; a channel that is gone is not an error here (its end is)."""
        with self._send_lock:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(line)
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                pass

    def silent(self) -> bool:
        """End the client of an agent silent for AGENT_SILENCE_S, or of a host that has talked
        for HELLO_S without its agent's hello (the hub's thread). True when it did."""
        if self._why is not None:
            return False
        now = time.monotonic()
        if self.heard is not None and now - self.heard > AGENT_SILENCE_S:
            self.fail(f"no word from the agent for {AGENT_SILENCE_S:g} s (the link is down?)")
            return True
        if self.heard is None and self.first_words is not None:
            if now - self.first_words > HELLO_S:
                self.fail(f"the agent did not start within {HELLO_S:g} s{self._words()}")
                return True
        return False

    def _words(self) -> str:
        said = self.reader.last_words()
        return f"; the host's login shell said: {said!r}" if said else ""

    def fail(self, why: str) -> None:
        """End this agent (the hub's thread): its client is ended, the channel's end follows and
        each of its tasks ends with LOST_EXIT, its log saying ``why``."""
        if self._why is not None:
            return
        self._why = why
        procs.signal_group(self.proc.pid, self.end_signal)

    def heartbeat(self) -> None:
        """A heartbeat, unless a command is being written (which says as much)."""
        if self._send_lock.acquire(blocking=False):
            self._send_lock.release()
            self._write(b"\n")

    def add(self, handle: AgentHandle, request: dict, standby: int | None = None) -> None:
        """Start ``handle``'s task on this machine (from the agent's ``standby`` if given: the
        agent starts it cold from ``request`` should that standby have died)."""
        with self.lock:
            if self.lost is None:
                self.tasks[handle.number] = handle
                if self.reader.spoke:
                    self._show_words(handle)
            else:
                handle.say(self._lost_line())
                handle.end(LOST_EXIT)
                return
        used = {} if standby is None else {"standby": standby}
        self.send("start", handle.number, request=request, **used)

    def _show_words(self, handle: AgentHandle) -> None:
        """What the host said before its agent's hello, at the top of the task's log."""
        if self.reader.banner_size:
            handle.say(
                f"distlaunch: {self.target} said before its agent started (its login shell?):\n"
                + bytes(self.reader.banner).decode(errors="replace").rstrip("\n")
                + "\n"
            )

    def read_frames(self) -> bool:
        """Read what the agent sent (the hub's thread); False at the channel's end, or once the
        agent is ended for what it sent (`fail`)."""
        try:
            chunk = os.read(self.out, 1 << 16)
        except OSError:
            return False
        if not chunk:
            return False
        if self._why is not None:
            return True  # ended already: what is left is read, not trusted
        spoke = self.reader.spoke
        try:
            frames = self.reader.feed(chunk)
        except Unreadable as exc:
            self.fail(f"the agent sent an unreadable frame ({exc})")
            return True
        now = time.monotonic()
        if not self.reader.spoke:
            self.first_words = self.first_words or now
            if self.reader.banner_size > BANNER_MAX:
                self.fail(f"the host printed {BANNER_MAX} bytes and no agent{self._words()}")
            return True
        self.heard = now
        if not spoke:
            with self.lock:
                for handle in self.tasks.values():
                    self._show_words(handle)
        for got in frames:
            try:
                self._frame(got)
            except (ValueError, UnicodeDecodeError) as exc:
                self.fail(f"the agent sent an unreadable frame ({got.kind.decode()}: {exc})")
                return True
        return True

    def _frame(self, got: Frame) -> None:
        """One frame; ValueError when its payload is not what its kind carries."""
        if got.kind == b"g":
            self._answered(got.payload)
            return
        if got.kind == b"e":
            self._refused(got.payload)
            return
        if got.kind == b"h":
            return
        with self.lock:
            handle = self.tasks.get(got.number)
            if handle is None:
                self._standby_frame(got)
            elif got.kind == b"o":
                handle.output(got.payload)
            elif got.kind == b"s":
                pid, *warm = got.payload.split(b" ")
                _number(pid, "a pid")
                handle.warm = handle.warm and warm == [b"warm"]
                handle.started.set()
            elif got.kind == b"x":
                code = _number(got.payload, "an exit code", 255)
                del self.tasks[handle.number]
                handle.end(code)

    def _standby_frame(self, got: Frame) -> None:
        """A frame about one of the agent's standbys (the hub's thread, under the lock)."""
        standby = self.standbys.get(got.number)
        if standby is None:
            return
        if got.kind in (b"s", b"x"):
            _number(got.payload, "a pid or an exit code")
        standby.frame(got.kind, got.payload)
        if got.kind == b"x":
            del self.standbys[got.number]

    def guard(self, request: dict) -> None:
        """Make the agent this machine's firewall guard (`firewall.HostRules.request`); its
        answer comes as `guard_answer`. Where the request says ``required``, an agent that
        cannot install the rules starts no task (`distlaunch.host.wall`) and is ended here,
        naming why: a restarted agent too."""
        self.guard_required = request.get("required") is True
        self.send("guard", request=request)

    def _answered(self, payload: bytes) -> None:
        answer = json.loads(payload)
        if not isinstance(answer, dict):
            raise ValueError("a firewall answer that is not a JSON object")
        self.guard_answer = answer
        self.guard_answered.set()
        if self.guard_required and not answer.get("protected"):
            self.fail(
                'network.protect is "required" and its firewall could not be installed: '
                f"{answer.get('why', 'no reason given')}"
            )

    def _refused(self, payload: bytes) -> None:
        """The agent refused a command (``e``): a line in that task's log; nothing ends."""
        refusal = json.loads(payload)
        if not isinstance(refusal, dict):
            raise ValueError("a refusal that is not a JSON object")
        self.refusals.append(refusal)
        with self.lock:
            handle = self.tasks.get(refusal.get("id", 0))
        if handle is not None:
            handle.say(f"distlaunch: the agent refused a command: {refusal.get('error')}\n")

    def why_lost(self) -> str:
        """What the client said last on stderr (ssh's own error), or how it exited."""
        said = [x for x in self._err_tail.decode(errors="replace").splitlines() if x.strip()]
        return said[-1].strip() if said else f"its client exited with {self.proc.returncode}"

    def read_errors(self) -> bool:
        """Keep the end of what the client says on stderr (ssh's own errors); False at EOF."""
        try:
            chunk = os.read(self.err, 1 << 16)
        except OSError:
            return False
        self._err_tail = (self._err_tail + chunk)[-4096:]
        return bool(chunk)

    def end(self) -> None:
        """The channel has ended: each task still running on the machine ends with LOST_EXIT,
        its log saying why (once)."""
        try:
            self.proc.wait(timeout=CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            procs.kill_groups([self.proc])
        with self.lock:
            if self.lost is not None:
                return
            self.lost = self._why or self._lost_reason()
            self.guard_answered.set()  # with no answer, if none came
            line = self._lost_line()
            for handle in self.tasks.values():
                handle.say(line)
                handle.end(LOST_EXIT)
            self.tasks.clear()

    def _lost_reason(self) -> str:
        if self.reader.spoke:
            return self.why_lost()
        return f"its agent never started ({self.why_lost()}){self._words()}"

    def _lost_line(self) -> str:
        return f"distlaunch: lost the agent on {self.target}: {self.lost}\n"

    def close(self) -> None:
        """EOF to the agent (it kills whatever still runs there), then wait for its client;
        its tasks end as lost (none, when they were stopped first)."""
        self.hang_up()
        self.end()

    def hang_up(self) -> None:
        """EOF to the agent: it kills whatever still runs there and exits."""
        with self._send_lock:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.close()
            except OSError:
                pass


def _number(payload: bytes, what: str, most: int = 1 << 31) -> int:
    """``payload`` as a number 0 to ``most``; ValueError naming ``what`` otherwise."""
    if not (payload.isdigit() and len(payload) <= 10 and int(payload) <= most):
        raise ValueError(f"{what} that is not a number 0-{most}: {payload[:40]!r}")
    return int(payload)
