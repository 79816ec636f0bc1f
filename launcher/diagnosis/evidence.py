"""A failed task's exception, read back from its error file or its log, made short enough to show.

The failure summary must name the exception and where it was raised in a few lines. TensorFlow's
messages can hold whole tensors (a `PerReplica` dump is thirty lines of numbers), so only the
message's first and last lines are kept, long lines and array reprs are clipped, and the full
text stays where it was (the error file, the log). Reading only: nothing here writes a file.

The error file (written by `distlaunch.worker`'s hook) is preferred. A program that never imports
`distlaunch.worker` has none: its traceback is then the last `Traceback (most recent call last):`
block at the end of its log, as Python printed it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# A summary line longer than this is clipped (the full line stays in the log).
MAX_LINE = 160
TRACEBACK_START = "Traceback (most recent call last):"
# `ValueError: ...`, `tensorflow.python.framework.errors_impl.UnknownError: ...`, `Exception`
_EXCEPTION_LINE = re.compile(
    r"^(?P<type>(?:[A-Za-z_][\w.]*)?(?:Error|Exception|Exit|Interrupt|Warning))"
    r"(?::\s?(?P<message>.*))?$"
)
# numpy's reprs: `array([[0.1, 0.2], ...])` and tensors' `numpy=...` payloads
_ARRAY = re.compile(r"array\(\[.*?(\]\)|$)")
_NUMBERS = re.compile(r"\[[-+0-9.eE, \[\]]{24,}\]?")


@dataclass(frozen=True)
class Evidence:
    """A task's exception: type, message and the frames of its traceback (code lines included)."""

    type: str  # the exception's class name as printed, e.g. ValueError
    message: str  # the full message, possibly many lines
    frames: tuple[tuple[str, str], ...] = ()  # (`File "...", line N, in f`, its code line)

    @property
    def short_type(self) -> str:
        """The class name without its module: ``UnknownError``."""
        return self.type.rsplit(".", 1)[-1]

    def first_line(self) -> str:
        """``Type: first line of the message``, clipped."""
        lines = self.message.splitlines()
        return clip(f"{self.type}: {lines[0]}" if lines and lines[0] else self.type)

    def condensed(self) -> list[str]:
        """The traceback in a few clipped lines: the outermost frame (where the program called
        in), the innermost (where it was raised), and the message's first and last lines, each
        with how much was left out."""
        out: list[str] = []
        shown = [*self.frames[:1], *self.frames[1:][-1:]]
        if shown:
            skipped = len(self.frames) - len(shown)
            left_out = (
                f"; {skipped} frame{'s' if skipped != 1 else ''} between left out"
                if skipped
                else ""
            )
            out.append(f"{TRACEBACK_START[:-2]}{left_out}):")
        for where, code in shown:
            out += ["  " + clip(where), *(["    " + clip(code)] if code else [])]
        lines = self.message.splitlines() or [""]
        out.append(self.first_line())
        if len(lines) > 2:
            out.append(f"  ... ({len(lines) - 2} more lines)")
        if len(lines) > 1:
            out.append(clip(lines[-1]))
        return out


def clip(line: str, width: int = MAX_LINE) -> str:
    """``line`` with array reprs collapsed and cut to ``width`` characters (marked with ``...``)."""
    line = _NUMBERS.sub("[...]", _ARRAY.sub("array([...])", line.rstrip()))
    return line if len(line) <= width else line[: width - 4].rstrip() + " ..."


def from_error_file(error: object) -> Evidence | None:
    """The evidence in a parsed error file (type, message, traceback), or None if it has none."""
    if not isinstance(error, dict) or not error.get("type"):
        return None
    parsed = from_traceback(str(error.get("traceback") or ""))
    frames = parsed.frames if parsed else ()
    return Evidence(str(error["type"]), str(error.get("message") or ""), frames)


def from_log(text: str) -> Evidence | None:
    """The last traceback Python printed in ``text`` (a log's tail), or None if there is none."""
    start = text.rfind(TRACEBACK_START)
    return from_traceback(text[start:]) if start >= 0 else None


def from_traceback(text: str) -> Evidence | None:
    """Parse one printed traceback: its frames, then the exception line and the message's lines."""
    lines = text.splitlines()
    if not lines or lines[0].strip() != TRACEBACK_START:
        return None
    frames: list[tuple[str, str]] = []
    i = 1
    while i < len(lines) and lines[i].startswith("  "):
        if lines[i].lstrip().startswith('File "'):
            code = (
                lines[i + 1].strip()
                if i + 1 < len(lines) and lines[i + 1].startswith("    ")
                else ""
            )
            frames.append((lines[i].strip(), code))
        i += 1
    rest = lines[i:]
    if not rest:
        return None
    match = _EXCEPTION_LINE.match(rest[0].strip())
    if match is None:
        return Evidence(rest[0].strip(), "\n".join(rest[1:]), tuple(frames))
    message = "\n".join([match.group("message") or "", *rest[1:]]).strip("\n")
    return Evidence(match.group("type"), message, tuple(frames))


# What a task prints when a peer died under it: gRPC's UNAVAILABLE, closed sockets, the
# coordination service's missed heartbeats and aborted collectives. Never a root cause.
_PEER_LOST = re.compile(
    r"UnavailableError|\bUNAVAILABLE\b|[Ss]ocket closed|Connection reset by peer"
    r"|failed to connect to all addresses|[Cc]oordination ?[Ss]ervice|heartbeat timeout"
    r"|[Cc]ollective ops is aborted|AbortedError|peer.{0,40}(lost|disconnected|unreachable)"
    r"|Connection refused|DeadlineExceededError",
)
_DIGITS = re.compile(r"\d+")
# TensorFlow names the tasks it lost: "The following tasks are unhealthy (stopped sending
# heartbeats):\n/job:worker/replica:0/task:1".
_LOST_LIST = re.compile(r"unhealthy[^:]*:\s*((?:/job:\w+/replica:\d+/task:\d+\s*)+)")
_TASK = re.compile(r"/job:(\w+)/replica:\d+/task:(\d+)")


def peer_lost(found: Evidence | None) -> bool:
    """Whether ``found`` is a follow-on error of a peer's death rather than a failure of its own."""
    if found is None:
        return False
    return _PEER_LOST.search(f"{found.type}: {found.message}") is not None


def lost_tasks(found: Evidence | None) -> tuple[str, ...]:
    """The tasks a follow-on error names as lost (``worker-1``), in its order; () if none."""
    if found is None:
        return ()
    match = _LOST_LIST.search(found.message)
    if match is None:
        return ()
    return tuple(dict.fromkeys(f"{job}-{index}" for job, index in _TASK.findall(match.group(1))))


def fingerprint(found: Evidence | None) -> str | None:
    """What stays the same when a program fails the same way again: the exception type, its
    message's first line and the frames, with numbers (steps, pids, addresses) left out."""
    if found is None:
        return None
    first = (found.message.splitlines() or [""])[0]
    parts = [found.type, first, *(where for where, _code in found.frames)]
    return _DIGITS.sub("N", "\n".join(parts))
