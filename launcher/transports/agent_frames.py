"""Reading an agent's channel (`distlaunch.host.channel` has the format), trusting nothing in it.

A host's stdout carries whatever its login shell prints before the agent runs (a ``.bashrc``
line, a motd, a conda banner), then the agent's hello, then frames. `FrameReader` is pure: fed
the bytes as they come, it keeps what came before the hello as the host's words (`banner`), finds
the hello only at the start of a line and only with the magic, and from then on returns frames or
raises `Unreadable`: a header that is not ``KIND ID LENGTH``, a kind the protocol has not, a
length beyond PAYLOAD_MAX, a frame not closed by its newline. It never holds more than one frame
and one header's worth of bytes, nor more than BANNER_KEEP of the banner.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from distlaunch.host import channel

# How much of a host's words before the hello is kept (the start goes first), and how many bytes
# of it end the wait for the hello at once (a shell that prints for ever).
BANNER_KEEP = 64 << 10
BANNER_MAX = 1 << 20
_HEADER = re.compile(rb"([A-Za-z]) (0|[1-9][0-9]{0,9}) (0|[1-9][0-9]{0,9})")
_HELLO = re.compile(
    rb"\n%s ([0-9]{1,9}) %d\n%s\n"
    % (re.escape(channel.HELLO_KIND), len(channel.MAGIC), re.escape(channel.MAGIC))
)
# Bytes at the end of the banner that may be the start of a hello (kept back until they are not).
_HELLO_TAIL = len(channel.hello()) + 8


class Unreadable(Exception):
    """The channel carried something that is not a frame of this protocol; the message says what."""


@dataclass(frozen=True)
class Frame:
    """One frame after the hello."""

    kind: bytes
    number: int
    payload: bytes


class FrameReader:
    """One channel's bytes, read as the hello and frames (the module docstring)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self.spoke = False  # the hello came
        self.banner = bytearray()  # what the host said before it (the last BANNER_KEEP bytes)
        self.banner_size = 0  # how much that was in all
        self._line_start = True  # the banner so far ends a line (a hello may start here)

    def feed(self, chunk: bytes) -> list[Frame]:
        """The frames ``chunk`` completes; Unreadable at the first byte that is not one."""
        self._buffer += chunk
        if not self.spoke and not self._hello():
            return []
        frames = []
        while True:
            end_of_header = self._buffer.find(b"\n", 0, channel.HEADER_MAX + 1)
            if end_of_header < 0:
                if len(self._buffer) > channel.HEADER_MAX:
                    raise Unreadable(
                        f"a header longer than {channel.HEADER_MAX} bytes: {self._show()}"
                    )
                return frames
            found = _HEADER.fullmatch(self._buffer, 0, end_of_header)
            if found is None:
                raise Unreadable(f"not a frame header: {self._show(end_of_header)}")
            kind, number, size = found.group(1), int(found.group(2)), int(found.group(3))
            if kind[0] not in channel.KINDS:
                raise Unreadable(f"a frame of unknown kind {kind.decode()!r}")
            if size > channel.PAYLOAD_MAX:
                raise Unreadable(f"a frame of {size} bytes (at most {channel.PAYLOAD_MAX})")
            end = end_of_header + 1 + size
            if len(self._buffer) <= end:
                return frames
            if self._buffer[end] != 0x0A:
                raise Unreadable(f"a frame of {size} bytes not ended by a newline")
            frames.append(Frame(kind, number, bytes(self._buffer[end_of_header + 1 : end])))
            del self._buffer[: end + 1]

    def last_words(self) -> str:
        """The banner's last non-blank line (what the host said last before any hello), or ""."""
        lines = [x for x in bytes(self.banner).decode(errors="replace").splitlines() if x.strip()]
        return lines[-1].strip()[:200] if lines else ""

    def _hello(self) -> bool:
        """Look for the hello; move what cannot be part of it to the banner. True once found."""
        prefix = b"\n" if self._line_start else b"\0"
        found = _HELLO.search(prefix + self._buffer)
        if found is None:
            cut = max(0, len(self._buffer) - _HELLO_TAIL)
            self._keep(self._buffer[:cut])
            del self._buffer[:cut]
            return False
        start = max(0, found.start() + 1 - len(prefix))  # after the newline before it
        self._keep(self._buffer[:start])
        version = int(found.group(1))
        del self._buffer[: found.end() - len(prefix)]
        if version != channel.PROTOCOL:
            raise Unreadable(
                f"the agent speaks protocol {version}, this launcher {channel.PROTOCOL}; install "
                "the same distlaunch version on every host"
            )
        self.spoke = True
        return True

    def _keep(self, said: bytes | bytearray) -> None:
        if not said:
            return
        self._line_start = said.endswith(b"\n")
        self.banner_size += len(said)
        room = BANNER_KEEP - len(self.banner)
        if room > 0:
            self.banner += said[:room]

    def _show(self, end: int | None = None) -> str:
        return repr(bytes(self._buffer[: min(end if end is not None else 40, 40)]))
