"""Live task output: follow each task's log file and echo new lines with a `worker-0 | ` prefix.

Tasks write straight into their log files (the launcher is never in their write path, so a slow
terminal cannot slow training and every line reaches the log even if the launcher dies). The
launcher follows the files in large reads and prefixes whole chunks at once.

The terminal never holds the launcher either: what is echoed goes through a `Terminal`, a bounded
queue that one background thread writes out. A stdout nobody reads (`| less` paused, Ctrl-S) only
makes the echo lossy (a note says how much was not shown; the log files have everything), and a
closed one (`| head -3`) is ignored, while supervision goes on.
"""

from __future__ import annotations

import atexit
import collections
import functools
import os
import re
import shutil
import sys
import threading
import time
from typing import BinaryIO

_COLORS = (36, 33, 35, 32, 34, 91, 96, 93, 95, 92)
_READ = 1 << 20
# At most this much echo waits for a slow terminal; more is dropped (the logs keep it).
MAX_PENDING = 4 * _READ
# A line longer than this is echoed in pieces of this size, so the echo holds no more than this
# of a task's unfinished line.
MAX_LINE = 64 * 1024
# At exit, how long the echo may go without progress before the rest is given up.
CLOSE_WAIT_S = 2.0


class Terminal:
    """A write-only stream the launcher never waits on: writes are queued (up to MAX_PENDING
    bytes; the rest is dropped, with a note) and a daemon thread writes them to the fd.

    The thread writes with os.write, never through the stream's buffer object: a daemon thread
    blocked inside a BufferedWriter would make the interpreter abort at exit.
    """

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream
        self._fd = stream.fileno()
        self._queue: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._dropped = 0
        self._broken = False  # the reader is gone (EPIPE): everything is discarded
        self._writing = False
        self._footer = b""  # the live line kept below the output (a terminal only)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        atexit.register(self.close)

    def isatty(self) -> bool:
        """Whether the stream is a terminal."""
        return os.isatty(self._fd)

    def write(self, data: bytes) -> None:
        """Queue ``data``; drop it (and count it) when MAX_PENDING bytes already wait."""
        with self._cond:
            if self._broken or not data:
                return
            if self._size + len(data) > MAX_PENDING:
                self._dropped += len(data)
                return
            self._note_dropped()
            if self._footer:  # erase the live line, write, draw it again below
                data = _ERASE_LINE + data + self._footer
            self._push(data)

    def footer(self, text: bytes) -> None:
        """Keep ``text`` (one line, no newline) drawn below everything written: the live line
        of a terminal. Empty bytes erase it."""
        with self._cond:
            if self._broken or text == self._footer or self._size + len(text) > MAX_PENDING:
                return
            self._footer = text
            self._push(_ERASE_LINE + text)

    def _note_dropped(self) -> None:
        if self._dropped:
            note = (
                f"[distlaunch: {self._dropped} bytes of output were not shown here (the terminal "
                "did not keep up); the log files have everything]\n"
            )
            self._dropped = 0
            self._push(note.encode())

    def room(self) -> int:
        """How many bytes may be written before writes are dropped (a reader that is gone takes
        everything: it is discarded at once)."""
        with self._cond:
            return MAX_PENDING if self._broken else max(0, MAX_PENDING - self._size)

    def flush(self) -> None:
        """Nothing to do: the writer thread writes as soon as the fd takes it."""

    def close(self) -> None:
        """Give the queue time to drain while it makes progress (at most CLOSE_WAIT_S without)."""
        with self._cond:
            if not self._broken:
                self._note_dropped()
            last, seen = time.monotonic(), self._size
            while (self._queue or self._writing) and not self._broken:
                if self._size != seen:
                    last, seen = time.monotonic(), self._size
                left = CLOSE_WAIT_S - (time.monotonic() - last)
                if left <= 0:
                    return
                self._cond.wait(min(left, 0.1))

    def _push(self, data: bytes) -> None:
        self._queue.append(data)
        self._size += len(data)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="terminal", daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._writing = False
                    self._cond.notify_all()
                    self._cond.wait()
                data = b"".join(self._queue)
                self._queue.clear()
                self._writing = True
            try:
                view = memoryview(data)
                while view:
                    written = os.write(self._fd, view)
                    view = view[written:]
                    with self._cond:
                        self._size -= written
                        self._cond.notify_all()
            except OSError:  # EPIPE and friends: nobody will read this stream again
                with self._cond:
                    self._broken = True
                    self._queue.clear()
                    self._size = 0
                    self._writing = False
                    self._cond.notify_all()
                return


def _terminal(stream: BinaryIO) -> Terminal | BinaryIO:
    """``stream`` as a Terminal when it has a file descriptor (a real stdout or stderr)."""
    if isinstance(stream, Terminal):
        return stream
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        return stream
    return Terminal(stream)


def _same_file(a: BinaryIO, b: BinaryIO) -> bool:
    """Whether two streams write to one file (a terminal's stdout and stderr): one queue then
    keeps their lines in order."""
    try:
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (AttributeError, OSError, ValueError):
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


# TensorFlow's start-up noise, hidden from the console (never from the log files) unless the
# spec says "tf_log_level": "all": every C++ INFO record, in absl's format (`I0000 00:00:17...
# 123 file.cc:31] ...`) or TensorFlow's own (`2024-01-01 12:00:00.1: I tensorflow/...`), and
# the known harmless warnings: oneDNN's notice, the CUDA/cuDNN/cuFFT/cuBLAS probes of a machine
# without a GPU, cpu_feature_guard (and the line it continues on), and absl's pre-init notice.
#
# A C++ record is one write of the task, so its lines are never interleaved with the program's
# own; a multi-line record goes on in one of two shapes, dropped with it:
# - a protobuf dump (`SessionOptions: goo.gle/debugstr` then `device_count {` ...): protobuf's
#   DebugString heads every dump with a `goo.gle/debug...` marker and never holds an empty line,
#   and the record ends with one (the dump's newline, then the record's);
# - a status with its op context (`... End of sequence` then `\t [[{{node ...}}]]`): lines that
#   start with a tab.
_RECORD = (
    rb"(?:I\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] "
    rb"|\d{4}-\d\d-\d\d [\d:.]+: I [\w/.]+:\d+\] "
    rb"|(?:[WE]\d{4} [\d:.]+ +\d+ |\d{4}-\d\d-\d\d [\d:.]+: [WE] )[\w/.]+:\d+\] (?="
    rb"Unable to register cu\w+ factory|failed call to cuInit|Could not find cuda drivers"
    rb"|computation placer already registered|TF-TRT Warning: Could not find TensorRT"
    rb"|This TensorFlow binary is optimized|Input of GeneratorDatasetOp::Dataset will not be "
    rb"optimized))"
)
# protobuf picks one of these markers at random (debugonly, debugproto, debugstr).
_PROTO_MARK = rb"goo\.gle/debug(?:only|proto|str)"
TF_NOISE = (
    rb"^(?:"
    + _RECORD
    + rb"(?:(?P<proto>[^\n]*"
    + _PROTO_MARK
    + rb"[^\n]*\n(?:[^\n]+\n)*)(?P<proto_end>\n)?"
    + rb"|[^\n]*\n(?P<tab>(?:\t[^\n]*\n)*))"
    rb"|/job:\w+/replica:\d+/task:\d+\n"  # an INFO line's straggler list
    rb"|WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR\n"
    rb"|To enable the following instructions: [^\n]*with the appropriate compiler flags\.\n"
    rb"|[^\n]*oneDNN custom operations are on[^\n]*\n"
    rb")"
)
# The tab lines that go on with a record cut off at the end of a piece (see QuietFilter).
_TAB_LINES = re.compile(rb"(?:\t[^\n]*\n)*")
# Bytes every TF_NOISE line holds: a chunk without them is echoed without running the regex.
_NOISE_HINTS = (b"] ", b"absl::", b"rebuild TensorFlow", b"oneDNN", b"/job:")


class QuietFilter:
    """Drops TensorFlow's start-up noise (TF_NOISE) from one task's output, given in pieces of
    complete lines: a multi-line record cut off between two pieces is dropped whole."""

    def __init__(self) -> None:
        # The shape of the dropped record that the last piece ended in, which may go on in the
        # next one: "proto" (until an empty line), "tab" (while lines start with a tab), or None.
        self._open: str | None = None

    def filter(self, body: bytes) -> bytes:
        """``body`` (complete lines) without TensorFlow's noise."""
        if self._open == "proto":  # it ends with the first empty line
            if body.startswith(b"\n"):
                end = 1
            else:
                end = body.find(b"\n\n") + 2
                if end < 2:
                    return b""
            self._open, body = None, body[end:]
        elif self._open == "tab":
            end = _TAB_LINES.match(body).end()
            if end == len(body):
                return b""
            self._open, body = None, body[end:]
        if not any(hint in body for hint in _NOISE_HINTS):
            return body
        return _tf_noise().sub(self._drop, body)

    def _drop(self, match: re.Match[bytes]) -> bytes:
        # A record that reaches the end of the piece may go on in the next one.
        if match.end() == len(match.string):
            if match.group("proto") is not None and match.group("proto_end") is None:
                self._open = "proto"
            elif match.group("tab") is not None:
                self._open = "tab"
        return b""


@functools.cache
def _tf_noise() -> re.Pattern[bytes]:
    """TF_NOISE compiled (MULTILINE), at the first output that may hold it: compiling it takes
    ~0.5 ms, which a run's first task need not wait for (bench/startup.py)."""
    return re.compile(TF_NOISE, re.MULTILINE)


def hide_tf_noise(body: bytes) -> bytes:
    """``body`` (complete lines) without TensorFlow's start-up noise (see TF_NOISE)."""
    return QuietFilter().filter(body)


_ERASE_LINE = b"\r\x1b[K"


class Console:
    """Where prefixed task output and the launcher's own messages go.

    ``quiet_tf``: task output is echoed without TensorFlow's start-up noise (TF_NOISE).
    """

    def __init__(
        self,
        out: BinaryIO | Terminal | None = None,
        err: BinaryIO | Terminal | None = None,
        color: bool | None = None,
        quiet_tf: bool = False,
    ) -> None:
        out = out or sys.stdout.buffer
        err = err or sys.stderr.buffer
        self.out = _terminal(out)
        self.err = self.out if out is err or _same_file(out, err) else _terminal(err)
        self.color = self.out.isatty() if color is None else color
        self.quiet_tf = quiet_tf
        # A live progress line only on a terminal: piped output stays one line per event.
        self.live = isinstance(self.out, Terminal) and self.out.isatty()

    def show_live(self, line: str | None) -> None:
        """Show ``line`` as the live line at the bottom of the terminal (None: remove it)."""
        if self.live:
            width = shutil.get_terminal_size().columns - 1
            self.out.footer((line or "")[:width].encode())

    def prefix(self, name: str, number: int, width: int) -> bytes:
        """The prefix put before each line of task ``name`` (the ``number``-th task), padded."""
        text = f"{name:<{width}} | "
        if self.color:
            text = f"\x1b[{_COLORS[number % len(_COLORS)]}m{text}\x1b[0m"
        return text.encode()

    def say(self, message: str) -> None:
        """Print a launcher message (to stderr, so task output on stdout stays clean to pipe)."""
        self.err.write(f"distlaunch: {message}\n".encode())


class LogFollower:
    """Follows one task's log file from a byte offset and echoes complete lines with a prefix."""

    def __init__(self, path: str, prefix: bytes, console: Console) -> None:
        self.path = path
        self.prefix = prefix
        self.console = console
        self._fd: int | None = None
        self._partial = b""
        self._progress = b""  # the progress state echoed last
        self._closed = False
        self._quiet = QuietFilter() if console.quiet_tf else None

    def skip_to_end(self) -> None:
        """Start following from the file's current end (what is there already is not echoed)."""
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return
        os.lseek(self._fd, 0, os.SEEK_END)

    def pump(self, budget: int = 8 * _READ, force: bool = False) -> bool:
        """Echo what was appended since the last call, up to ``budget`` bytes; True if more may
        wait now. Unless ``force``d, no more than the terminal has room for is read."""
        if self._closed:
            return False
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                return False
        # A terminal that does not keep up is not fed: the rest waits in the log file (no loss,
        # no memory) until it takes more. Only close() pushes past it.
        room = getattr(self.console.out, "room", None)
        limited = False
        if room is not None and not force and room() < budget:
            budget, limited = room(), True
        read = 0
        while read < budget:
            chunk = os.read(self._fd, min(_READ, budget - read))
            if not chunk:
                return False
            read += len(chunk)
            self._emit(chunk)
        # Held back by the terminal: the caller waits its usual interval instead of spinning.
        return not limited

    def _emit(self, chunk: bytes) -> None:
        data = self._partial + chunk
        cut = data.rfind(b"\n") + 1
        rest = data[cut:]
        if cut:
            body = data[:cut]
            if b"\r" in body:  # a line that a progress bar rewrote: only its final state shows
                body = b"\n".join(_latest(line) for line in body[:-1].split(b"\n")) + b"\n"
            if self._quiet is not None:
                body = self._quiet.filter(body)
            if _has_long_line(body):  # rare: only then a Python loop per line
                body = b"".join(_pieces(line) for line in body[:-1].split(b"\n"))
            # One C-level replace per chunk instead of a Python loop per line.
            if body:
                lines = body[:-1].replace(b"\n", b"\n" + self.prefix)
                self.console.out.write(self.prefix + lines + b"\n")
            self._progress = b""
        # A carriage return ends one state of a progress bar (tqdm): echo the latest complete
        # state as a line, once, and keep only the state being written.
        ret = rest.rfind(b"\r")
        if ret >= 0:
            state = _latest(rest[:ret])
            if state.strip() and state != self._progress:
                self.console.out.write(self.prefix + state[:MAX_LINE] + b"\n")
                self._progress = state
            rest = rest[ret + 1 :]
        while len(rest) > MAX_LINE:
            self.console.out.write(self.prefix + rest[:MAX_LINE] + b"\n")
            rest = rest[MAX_LINE:]
        self._partial = rest

    def close(self) -> None:
        """Echo everything left, including a last line without a newline, and close the file."""
        while self.pump(force=True):
            pass
        self._closed = True
        last = _latest(self._partial) + b"\n"
        if self._quiet is not None:
            last = self._quiet.filter(last)
        if last.strip():
            self.console.out.write(self.prefix + last)
        self._partial = b""
        self.console.out.flush()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _has_long_line(body: bytes) -> bool:
    """Whether a line of ``body`` (complete lines) is longer than MAX_LINE, found in steps of up
    to MAX_LINE bytes (a C-level search each), not line by line."""
    start = 0
    while len(body) - start > MAX_LINE:
        # Every line that starts in this window and ends in it is short enough.
        end = body.rfind(b"\n", start, start + MAX_LINE + 1)
        if end < 0:
            return True
        start = end + 1
    return False


def _latest(line: bytes) -> bytes:
    """What a terminal would show of ``line``: the text after its last carriage return."""
    return line.rstrip(b"\r").rsplit(b"\r", 1)[-1]


def _pieces(line: bytes) -> bytes:
    """``line`` and its newline, cut into lines of at most MAX_LINE bytes."""
    return b"".join(line[i : i + MAX_LINE] + b"\n" for i in range(0, max(len(line), 1), MAX_LINE))
