"""The root-cause summary printed when a run fails: who failed first, how, and the evidence."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from distlaunch.launcher.rundir import read_json

TAIL_LINES = 20


@dataclass(frozen=True)
class Failure:
    """The task that failed first and where its evidence is."""

    task: str
    how: str  # "exit code 3", "signal SIGKILL", "did not join ...", ...
    log_file: str
    error_file: str
    elapsed_s: float
    note: str = ""  # why it was not restarted, when a restart policy is on


def headline(run_id: str, failure: Failure) -> str:
    """The one line that explains the failure."""
    error = read_json(Path(failure.error_file))
    cause = ""
    if isinstance(error, dict) and error.get("type"):
        cause = f": {error['type']}: {error.get('message', '')}".rstrip(": ")
    note = f" ({failure.note})" if failure.note else ""
    return f"run {run_id} failed: {failure.task} {failure.how} after {failure.elapsed_s:.1f} s{cause}{note}"


def details(failure: Failure) -> str:
    """The evidence under the headline: the error file's traceback, else the log's last lines."""
    error = read_json(Path(failure.error_file))
    if isinstance(error, dict) and error.get("traceback"):
        body = error["traceback"].rstrip("\n")
        source = failure.error_file
    else:
        body = tail(failure.log_file, TAIL_LINES)
        source = failure.log_file
    if not body:
        return f"  ({source} is empty)"
    lines = "\n".join(f"  | {line}" for line in body.splitlines())
    return f"  from {source}:\n{lines}"


def tail(path: str, lines: int) -> str:
    """Return the last ``lines`` lines of a file (reads only its end)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read()
    except OSError:
        return ""
    return b"\n".join(data.splitlines()[-lines:]).decode("utf-8", "replace")
