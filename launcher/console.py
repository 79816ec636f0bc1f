"""Live task output: follow each task's log file and echo new lines with a `worker-0 | ` prefix.

Tasks write straight into their log files (the launcher is never in their write path, so a slow
terminal cannot slow training and every line reaches the log even if the launcher dies). The
launcher follows the files in large reads and prefixes whole chunks at once.
"""

from __future__ import annotations

import os
import sys
from typing import BinaryIO

_COLORS = (36, 33, 35, 32, 34, 91, 96, 93, 95, 92)
_READ = 1 << 20


class Console:
    """Where prefixed task output and the launcher's own messages go."""

    def __init__(self, out: BinaryIO | None = None, err: BinaryIO | None = None, color: bool | None = None) -> None:
        self.out = out or sys.stdout.buffer
        self.err = err or sys.stderr.buffer
        self.color = self.out.isatty() if color is None else color

    def prefix(self, name: str, number: int, width: int) -> bytes:
        """The prefix put before each line of task ``name`` (the ``number``-th task), padded."""
        text = f"{name:<{width}} | "
        if self.color:
            text = f"\x1b[{_COLORS[number % len(_COLORS)]}m{text}\x1b[0m"
        return text.encode()

    def say(self, message: str) -> None:
        """Print a launcher message (to stderr, so task output on stdout stays clean to pipe)."""
        self.out.flush()
        self.err.write(f"distlaunch: {message}\n".encode())
        self.err.flush()


class LogFollower:
    """Follows one task's log file from a byte offset and echoes complete lines with a prefix."""

    def __init__(self, path: str, prefix: bytes, console: Console) -> None:
        self.path = path
        self.prefix = prefix
        self.console = console
        self._fd: int | None = None
        self._partial = b""
        self._closed = False

    def skip_to_end(self) -> None:
        """Start following from the file's current end (what is there already is not echoed)."""
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return
        os.lseek(self._fd, 0, os.SEEK_END)

    def pump(self, budget: int = 8 * _READ) -> bool:
        """Echo what was appended since the last call, up to ``budget`` bytes; True if more may wait."""
        if self._closed:
            return False
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                return False
        read = 0
        while read < budget:
            chunk = os.read(self._fd, _READ)
            if not chunk:
                return False
            read += len(chunk)
            self._emit(chunk)
        return True

    def _emit(self, chunk: bytes) -> None:
        data = self._partial + chunk
        cut = data.rfind(b"\n") + 1
        self._partial = data[cut:]
        if cut:
            body = data[:cut]
            # One C-level replace per chunk instead of a Python loop per line.
            self.console.out.write(self.prefix + body[:-1].replace(b"\n", b"\n" + self.prefix) + b"\n")

    def close(self) -> None:
        """Echo everything left, including a last line without a newline, and close the file."""
        while self.pump():
            pass
        self._closed = True
        if self._partial:
            self.console.out.write(self.prefix + self._partial + b"\n")
            self._partial = b""
        self.console.out.flush()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
