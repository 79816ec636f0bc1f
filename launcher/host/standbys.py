"""The agent's warm standbys (launcher/transports/agent_standby.py has the design): a standby is a
keeper whose task (a bootstrap) waits at its door, holding TensorFlow's import done, until the
launcher's ``start`` names it; its output is held here, never sent, until then.

``prepare`` starts one (its keeper gets DISTLAUNCH_STANDBY, naming its control socket, and the
bootstrap's env ``writes``); ``discard`` kills an unused one; a ``start`` with a ``standby``
makes it the task: its held output is sent as the task's, it is told to go, and the ``s`` frame
says ``warm``. One that died unused (or cannot hear its go) is no task: the task starts cold
from the request, and its ``s`` frame says so, so the launcher records a cold restart.
"""

from __future__ import annotations

import json
import selectors
import socket
from typing import Protocol

from distlaunch.host.channel import Command
from distlaunch.host.keepers import Keeper

# bootstrap.STANDBY_ENV, READY and GO (this package may not import the bootstrap: another
# module's job, and it imports what a task needs).
STANDBY_ENV = "DISTLAUNCH_STANDBY"
READY, GO = b"r", b"g"
# The most of a standby's output (its imports' warnings) held for the task it may become.
HELD_MAX = 1 << 20


class StandbyKeeper(Keeper):
    """A warm standby: a keeper whose task is held at the bootstrap's door until `go`, its output
    held here until then (HELD_MAX at most: beyond that it is dropped, and says so)."""

    def __init__(self, task: int, request: dict, writes: list) -> None:
        ours, theirs = socket.socketpair()  # both close-on-exec: the keeper gets its end alone
        order = {"fd": theirs.fileno(), "env": writes}
        request = {
            **request,
            "env": {**request.get("env", {}), STANDBY_ENV: json.dumps(order)},
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
            self.control.sendall(GO)
        except OSError:
            return False
        return True


class Host(Protocol):
    """What the standbys need of the agent."""

    keepers: dict[int, Keeper]
    sel: selectors.BaseSelector

    def emit(self, kind: bytes, task: int, payload: bytes) -> None:
        """Send one frame."""

    def watch(self, keeper: Keeper) -> None:
        """Read the keeper's output and learn of its exit."""

    def start_cold(self, task: int, request: dict) -> None:
        """Start ``task`` under a keeper of its own."""


def prepare(agent: Host, command: Command) -> None:
    """Start a standby (``prepare``): its ``s`` frame, or its ``x`` when none can be made (that
    task restarts cold)."""
    try:
        standby = StandbyKeeper(command.id, command.request, list(command.writes))
    except OSError:
        agent.emit(b"x", command.id, b"126")
        return
    agent.watch(standby)
    agent.sel.register(standby.control, selectors.EVENT_READ, ("control", standby))
    agent.emit(b"s", command.id, str(standby.pid).encode())


def discard(agent: Host, command: Command) -> None:
    """Kill an unused standby (its keeper's EOF: SIGKILL of its group); its ``x`` follows."""
    standby = agent.keepers.get(command.id)
    if isinstance(standby, StandbyKeeper) and standby.held is not None:
        release(agent, standby)
        standby.close_stdin()


def become(agent: Host, command: Command) -> None:
    """``start`` from the standby ``command.standby``: it becomes task ``command.id`` (``s`` says
    ``PID warm``), or, where it died or cannot hear its go, the task starts cold."""
    assert command.standby is not None
    standby = agent.keepers.get(command.standby)
    if not (
        isinstance(standby, StandbyKeeper)
        and standby.held is not None
        and standby.exited_at is None
        and standby.go()
    ):
        # It died unused (its end is on its way, under its own ID): a cold start.
        agent.start_cold(command.id, command.request)
        return
    release(agent, standby)
    del agent.keepers[command.standby]
    standby.task = command.id
    agent.keepers[command.id] = standby
    agent.emit(b"s", command.id, b"%d warm" % standby.pid)
    held, standby.held = bytes(standby.held), None
    if held:
        agent.emit(b"o", command.id, held)


def said(agent: Host, standby: StandbyKeeper) -> None:
    """The standby's control socket is readable: ``r`` (ready) or EOF (it died)."""
    try:
        word = standby.control.recv(1) if standby.control is not None else b""
    except OSError:
        word = b""
    if word == READY and standby.held is not None:
        agent.emit(b"r", standby.task, b"")
    if word != READY:
        release(agent, standby)


def release(agent: Host, standby: StandbyKeeper) -> None:
    """Stop watching the standby's control socket and close it (the standby reads EOF)."""
    if standby.control is not None:
        agent.sel.unregister(standby.control)
        standby.control.close()
        standby.control = None
