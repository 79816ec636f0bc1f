"""The agent transport: one agent per remote machine (`distlaunch.host.agent`) starts and watches
all of that machine's tasks, over the one channel of one local client (an ssh session).

A backend says how a machine's agent is started (`AgentTransport.agent_command`) and where a task's
stacks are read (`stacks`); the rest is here:
- `AgentLink` is one machine's agent: its local client, started like a local task (own process
  group, dies with the launcher by its parent-death signal), whose stdin carries the launcher's
  commands (start, stop, notice, kill, heartbeats) and whose stdout the agent's frames (each
  task's output, its start, its end). The first task of a machine starts its agent; every other
  task's start is one more line on the same channel, so a machine's tasks start side by side.
- `AgentHandle` is one task: its exit fd is a pipe the link writes to when the agent reports the
  task's end, so the supervisor's one `select` learns of it at once, as of a local task's.
- One thread (`_Hub`) reads every link's frames into the tasks' log files and sends the
  heartbeats. A link whose channel ends (the agent or its client died, the connection dropped)
  ends each of its tasks with LOST_EXIT and a line in its log naming the machine.
- Nothing a host sends is trusted (launcher/transports/agent_frames.py reads it): a login
  shell's words before the agent's hello are the host's, shown in its tasks' logs; an unreadable
  frame, a host that never says hello, an agent gone silent, and any failure serving a link (a
  log on a full disk) end that machine's agent alone, named, through the same lost-agent ending
  (no new event kind: the supervisor sees LOST_EXIT and the log's line, as for a cut link).
  The deadlines are `distlaunch.host.timeouts`'s.
"""

from __future__ import annotations

import functools
import json
import os
import select
import signal
import socket
import subprocess
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, Self

from distlaunch.host import channel
from distlaunch.host.timeouts import (
    AGENT_SILENCE_S,
    CLOSE_WAIT_S,
    HEARTBEAT_S,
    HEARTBEAT_TIMEOUT_S,
    HELLO_S,
    KILL_WAIT_S,
)
from distlaunch.launcher.diagnosis import stacks
from distlaunch.launcher.plan.plan import TaskPlan
from distlaunch.launcher.record import rundir
from distlaunch.launcher.transports import procs
from distlaunch.launcher.transports.agent_frames import BANNER_MAX, Frame, FrameReader, Unreadable
from distlaunch.launcher.transports.helper import (
    JOIN_CONNECT_TIMEOUT_S,
    STOP_MARGIN_S,
    relayed_status,
    request_of,
)

AGENT_MODULE = "distlaunch.host.agent"
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


def _raise(exc: Exception) -> None:
    raise exc


def _end_all(links: Sequence[AgentLink]) -> None:
    """End ``links``' agents side by side: each is told (EOF) before any is waited for, so that
    their ends (each removing its host's firewall rules) overlap, not one host after another."""
    for link in links:
        link.hang_up()
    for link in links:
        link.end()


class _Hub:
    """The one thread that reads every link's frames and sends every link's heartbeats.

    Nothing a link does ends the thread: an exception while serving one link (a log that cannot
    be written: a full disk; a bug) ends that link's agent with the error as the reason, named
    by its machine in its tasks' logs, and the thread goes on with the others."""

    def __init__(self) -> None:
        self._poll = select.poll()
        self._by_fd: dict[int, tuple[AgentLink, bool]] = {}
        self._new: list[AgentLink] = []
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._poll.register(self._wake_r, select.POLLIN)
        self._quit = False
        self._thread: threading.Thread | None = None
        self._links: list[AgentLink] = []

    def add(self, link: AgentLink) -> None:
        """Watch ``link`` from now on (the thread starts with the first)."""
        with self._lock:
            self._new.append(link)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="agents", daemon=True)
                self._thread.start()
        os.write(self._wake_w, b"w")

    def close(self) -> None:
        """Stop the thread (the links are closed already)."""
        self._quit = True
        os.write(self._wake_w, b"q")
        if self._thread is not None:
            self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        next_beat = time.monotonic() + HEARTBEAT_S
        while not self._quit:
            try:
                next_beat = self._serve_all(next_beat)
            except Exception as exc:  # noqa: BLE001 - no link's: every agent ends, named
                for link in list(self._links):
                    self._guarded(link, functools.partial(_raise, exc))

    def _serve_all(self, next_beat: float) -> float:
        """One round: new links, what is readable, and the beats when due; the next beat's time."""
        with self._lock:
            for link in self._new:
                self._links.append(link)
                for fd, is_out in ((link.out, True), (link.err, False)):
                    self._by_fd[fd] = (link, is_out)
                    self._poll.register(fd, select.POLLIN)
            self._new.clear()
        for fd, _ in self._poll.poll(max(0.0, next_beat - time.monotonic()) * 1000):
            if fd == self._wake_r:
                os.read(fd, 512)
                continue
            if fd not in self._by_fd:  # its link ended earlier in this batch
                continue
            link, is_out = self._by_fd[fd]
            self._guarded(link, lambda: self._serve(link, fd, is_out))
        if time.monotonic() >= next_beat:
            next_beat = time.monotonic() + HEARTBEAT_S
            for link in list(self._links):
                self._guarded(link, lambda: (link.silent(), link.heartbeat()))
        return next_beat

    def _guarded(self, link: AgentLink, work: Callable[[], object]) -> None:
        """Do ``work`` for ``link``; whatever it raises ends that link's agent, not the hub."""
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - any failure here is the link's end, named
            why = f"the launcher could not serve its channel: {type(exc).__name__}: {exc}"
            with link.lock:
                for handle in link.tasks.values():
                    handle.say(f"distlaunch: {link.target}: {why}\n{traceback.format_exc()}")
            link.fail(why)
            self._drop(link)

    def _serve(self, link: AgentLink, fd: int, is_out: bool) -> None:
        if link.read_frames() if is_out else link.read_errors():
            return
        self._poll.unregister(fd)
        del self._by_fd[fd]
        if is_out:
            if link.err in self._by_fd:  # what ssh said last, before naming the loss
                self._drain_errors(link)
            self._drop(link)

    def _drop(self, link: AgentLink) -> None:
        """Stop watching ``link`` and end its tasks (its client is ending or has ended)."""
        for fd in (link.out, link.err):
            if fd in self._by_fd:
                self._poll.unregister(fd)
                del self._by_fd[fd]
        if link in self._links:
            self._links.remove(link)
        link.end()

    def _drain_errors(self, link: AgentLink) -> None:
        self._poll.unregister(link.err)
        del self._by_fd[link.err]
        poller = select.poll()
        poller.register(link.err, select.POLLIN)
        while poller.poll(1000) and link.read_errors():
            pass


class StandbyTaker(Protocol):
    """The transport's side of its standbys (`agent_standby.AgentStandbys`)."""

    def take(self, task: TaskPlan) -> int | None:
        """The id of the live standby made for exactly ``task`` on its machine's current agent
        (no longer the pool's), or None: a cold start."""


def wait_ended(handles: Sequence[AgentHandle], timeout_s: float) -> list[AgentHandle]:
    """Wait up to ``timeout_s`` (for all together) for the handles' tasks to end; those that
    have not."""
    deadline = time.monotonic() + timeout_s
    pending = [h for h in handles if h.code is None]
    while pending:
        poller = select.poll()
        for handle in pending:
            poller.register(handle.exit_fd, select.POLLIN)
        left = deadline - time.monotonic()
        if left <= 0:
            break
        poller.poll(left * 1000)
        pending = [h for h in pending if h.code is None]
    return pending


class AgentTransport(ABC):
    """Starts tasks through one agent per machine and stops them (where they run: TERM, grace,
    KILL). A subclass says how a machine's agent is started and where a task's stacks are read."""

    def __init__(
        self,
        grace_s: float,
        umask: int | None,
        close_idle: bool = False,
        term_is_notice: bool = False,
    ) -> None:
        self.grace_s = grace_s
        self.umask = umask
        # End a machine's agent once `stop` or `kill` leaves it no task (a job step gives its
        # resources back); else it stays for the machine's next tasks.
        self.close_idle = close_idle
        # SIGTERM to an agent is a stop notice for its tasks, not a stop (a Slurm step's).
        self.term_is_notice = term_is_notice
        self.links: dict[str, AgentLink] = {}
        # The warm standbys, when the run has them (the backend sets them: agent_standby.py).
        self.standbys: StandbyTaker | None = None
        # By machine, the firewall rules its agent holds (`guard`): an agent started again after
        # its machine's was lost holds them again before its tasks start.
        self.guards: dict[str, dict] = {}
        self.clients_started = 0  # how many agents' clients this transport ran (benches)
        self._numbers = 0
        self._hub = _Hub()

    @abstractmethod
    def agent_command(self, machine: str) -> AgentCommand:
        """The local client that runs the agent of ``machine``."""

    @abstractmethod
    def stacks(self, handle: AgentHandle, native: bool) -> stacks.Source:
        """The task's program, read where it runs (never its local client)."""

    def request(self, task: TaskPlan) -> dict:
        """What the task's keeper on its machine reads (`distlaunch.host.remote`'s request)."""
        return request_of(task, self.umask, self.grace_s)

    def start(self, task: TaskPlan) -> AgentHandle:
        """Start one task through its machine's agent (started first if the machine has none),
        from the standby made for exactly this plan where there is one."""
        standby = self.standbys.take(task) if self.standbys is not None else None
        link = self.link_of(task.host_name)
        handle = AgentHandle(task, link, self.number(), warm=standby is not None)
        link.add(handle, self.request(task), standby)
        if standby is not None:
            # Whether the standby became the task is the agent's to say (one that died unused is
            # replaced by a cold start there): the supervisor records it as soon as this returns.
            # A restart from a standby is one task's; its round trip is the wait.
            if not handle.started.wait(AGENT_SILENCE_S):
                handle.warm = False
        return handle

    def link_of(self, machine: str) -> AgentLink:
        """The agent of ``machine``: started (and made its guard again, if it was one) unless
        one runs there."""
        link = self.links.get(machine)
        if link is None or link.lost is not None:
            command = self.agent_command(machine)
            link = self.links[machine] = AgentLink(command, self.term_is_notice)
            self.clients_started += 1
            self._hub.add(link)
            if machine in self.guards:
                link.guard(self.guards[machine])
        return link

    def number(self) -> int:
        """A new id on the channels (tasks and standbys alike: a standby's becomes no task's)."""
        self._numbers += 1
        return self._numbers

    def guard(self, requests: Mapping[str, dict], timeout_s: float) -> dict[str, dict | str]:
        """Make each machine's agent (started now, all at once) the guard of the run's firewall
        there (`requests`: `firewall.HostRules.request` by machine), and wait up to ``timeout_s``
        for every answer: the guard's answer line, or why there is none, by machine."""
        self.guards.update(requests)
        links = {machine: self.link_of(machine) for machine in requests}
        deadline = time.monotonic() + timeout_s
        answers: dict[str, dict | str] = {}
        for machine, link in links.items():
            if not link.guard_answered.wait(max(0.0, deadline - time.monotonic())):
                answers[machine] = f"its agent did not answer within {timeout_s:g} s"
            elif link.guard_answer is None:
                answers[machine] = f"its agent did not answer: {link.lost or link.why_lost()}"
            else:
                answers[machine] = link.guard_answer
        return answers

    def stop(self, handles: Sequence[AgentHandle], grace_s: float) -> None:
        """Ask every task's agent to stop it (SIGTERM, ``grace_s``, SIGKILL where it runs), wait
        that long plus a margin for the ends, then `kill` what is left."""
        for handle in handles:
            if handle.code is None:
                handle.link.send("stop", handle.number)
        self.kill(wait_ended(handles, grace_s + STOP_MARGIN_S))

    def kill(self, handles: Sequence[AgentHandle]) -> None:
        """End the tasks now: their keepers SIGKILL them where they run. An agent that does not
        report the ends within KILL_WAIT_S has its client ended, which ends all its tasks."""
        for handle in handles:
            if handle.code is None:
                handle.link.send("kill", handle.number)
        for handle in wait_ended(handles, KILL_WAIT_S):
            procs.kill_groups([handle.link.proc])
            handle.link.end()
        if self.close_idle:
            links = {id(h.link): h.link for h in handles}.values()
            _end_all([x for x in links if not x.tasks and not x.standbys and x.lost is None])

    def notify(self, handles: Sequence[AgentHandle]) -> bool:
        """A stop notice to every task (`NoticeTransport`): its keeper sends SIGTERM to the
        task's program alone, where it runs, and goes on watching it."""
        for handle in handles:
            if handle.code is None:
                handle.link.send("notice", handle.number)
        return True

    def close(self) -> None:
        """End every agent (their tasks must be stopped already) and the hub's thread."""
        _end_all(list(self.links.values()))
        self._hub.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
