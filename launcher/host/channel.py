"""The agent's channel to its launcher, as the agent speaks it: frames out, typed commands in.

Frames (the agent's stdout): ``KIND ID LENGTH\\n``, the payload, ``\\n``. The last newline is
not data: srun forwards a step's output a line at a time, so a frame that did not end a line
would wait in srun until the next one. The first frame is the hello, ``A PROTOCOL 16\\n``
``distlaunch-agent\\n`` (`hello`): whatever a host prints before it (a login shell's ``.bashrc``,
a motd script, a conda banner) is not the agent's, and the launcher keeps it as the host's words,
never as frames. After the hello every byte is a frame; a launcher that reads anything else ends
that host's agent (launcher/transports/agent_frames.py has the reader).

Commands (the agent's stdin): one JSON object a line, ``{"v": PROTOCOL, "op": OP, ...}``
(`parse_command`), or an empty line (a heartbeat). A line that is not a command of this protocol
is answered with an ``e`` frame and ends nothing.

Frames are written without ever blocking the agent (`Outbox`): a link that stalls without a
reset must not stop the agent's loop, which then still checks the launcher's heartbeat and ends
its tasks on its own. Output beyond OUTBOX_MAX waits in the keepers' pipes (the agent stops
reading them: the tasks block on their own writes, as they would on a slow terminal).

Standard library only: the agent runs by path on a Slurm node, without site-packages.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass, field

# Bumped whenever the frames, the commands or the keeper's request change (remote.PROTOCOL too);
# preflight refuses a host that speaks another. 6: a hello frame, typed commands, ``e`` frames.
PROTOCOL = 6
MAGIC = b"distlaunch-agent"
HELLO_KIND = b"A"
# The kinds of frame after the hello (launcher/host/agent.py's docstring says what each carries).
KINDS = frozenset(b"osxhgre")
# The largest payload the agent sends (a standby's held output, HELD_MAX, and its note) and the
# longest header: a launcher refuses more as unreadable.
PAYLOAD_MAX = 2 << 20
HEADER_MAX = 32
# How much the agent keeps unsent before it stops reading task output.
OUTBOX_MAX = 4 << 20
OPS = frozenset(("start", "stop", "notice", "kill", "prepare", "discard", "guard"))


def frame(kind: bytes, task: int, payload: bytes) -> bytes:
    """One frame (the module docstring)."""
    return b"%s %d %d\n" % (kind, task, len(payload)) + payload + b"\n"


def hello() -> bytes:
    """The agent's first frame: the magic, under this protocol's number."""
    return frame(HELLO_KIND, PROTOCOL, MAGIC)


class BadCommand(ValueError):
    """A command line that is not one of this protocol's; the message says why."""


@dataclass(frozen=True)
class Command:
    """One command from the launcher. ``id``: the task or standby it is about (0: none)."""

    op: str
    id: int = 0
    request: dict = field(default_factory=dict)
    standby: int | None = None  # ``start``: the standby that becomes the task
    writes: tuple = ()  # ``prepare``: the bootstrap's env writes


def parse_command(line: bytes) -> Command:
    """The command on ``line``; BadCommand when it is none of this protocol's."""
    try:
        data = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise BadCommand(f"not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise BadCommand("not a JSON object")
    if data.get("v") != PROTOCOL:
        raise BadCommand(f"protocol {data.get('v')!r}, this agent speaks {PROTOCOL}")
    op = data.get("op")
    if op not in OPS:
        raise BadCommand(f"unknown op {op!r}")
    number = data.get("id", 0)
    if type(number) is not int or number < 0:
        raise BadCommand(f"id must be a non-negative integer, got {number!r}")
    request = data.get("request", {})
    if not isinstance(request, dict):
        raise BadCommand("request must be a JSON object")
    standby = data.get("standby")
    if standby is not None and (type(standby) is not int or standby < 0):
        raise BadCommand(f"standby must be a non-negative integer, got {standby!r}")
    writes = data.get("writes") or []
    if not isinstance(writes, list):
        raise BadCommand("writes must be a list")
    if op in ("start", "prepare") and not request:
        raise BadCommand(f"{op} needs a request")
    return Command(op, number, request, standby, tuple(writes))


def command(op: str, number: int = 0, **fields: object) -> bytes:
    """The launcher's line for one command (`parse_command` reads it)."""
    return json.dumps({"v": PROTOCOL, "op": op, "id": number, **fields}).encode() + b"\n"


class Outbox:
    """Frames waiting for the launcher's end of the channel, written without blocking."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self._chunks: list[bytes] = []
        self.size = 0
        self.gone = False  # the channel broke: nothing more is written

    def put(self, data: bytes) -> None:
        """Queue ``data`` and write what the channel takes now."""
        if self.gone:
            return
        self._chunks.append(data)
        self.size += len(data)
        self.flush()

    def full(self) -> bool:
        """Whether the agent should stop reading task output until the launcher reads."""
        return self.size >= OUTBOX_MAX

    def waiting(self) -> bool:
        """Whether bytes wait for the channel to take them."""
        return self.size > 0 and not self.gone

    def flush(self) -> None:
        """Write what the channel takes now; never wait."""
        while self._chunks and not self.gone:
            try:
                written = os.write(self.fd, self._chunks[0])
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                self.gone = True  # EOF on stdin follows and ends everything
                self._chunks.clear()
                self.size = 0
                return
            self.size -= written
            if written == len(self._chunks[0]):
                self._chunks.pop(0)
            else:
                self._chunks[0] = self._chunks[0][written:]
