"""The root-cause summary printed when a run fails: who failed first, how, and the evidence."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from distlaunch.launcher.core.console import hide_tf_noise
from distlaunch.launcher.diagnosis import evidence, hints
from distlaunch.launcher.record.endings import EventKind
from distlaunch.launcher.record.rundir import read_json

TAIL_LINES = 20
# How far back from a log's end a traceback is looked for (tail() reads at most its last 64 KiB).
LOG_SCAN_LINES = 400


@dataclass(frozen=True)
class Failure:
    """The task that failed first and where its evidence is."""

    task: str
    how: str  # the words shown: "exit code 3", "signal SIGKILL", "did not start ...", ...
    log_file: str
    error_file: str
    elapsed_s: float
    note: str = ""  # why it was not restarted, when a restart policy is on
    stacks: tuple[str, ...] = ()  # where every task was (stacks.summary), when they were captured
    stacks_dir: str = ""  # the folder of those stacks files
    kind: EventKind = EventKind.EXITED  # how the task ended: exited, hung, a deadline...
    exit_code: int | None = None  # its exit code (negative: the signal) when it exited


def preempted_line(run_id: str, saved: dict, spec_file: str) -> str:
    """The line that says where a preempted run saved (``saved``: run.json's ``preempted``,
    ``step`` and ``save_s``, each None when unknown) and how it goes on."""
    step, save_s = saved.get("step"), saved.get("save_s")
    # No step: the program saved on its own (TensorFlow's handler), or had nothing to save.
    where = "on the notice" if step is None else f"at step {step}"
    took = "" if save_s is None else f", saved in {save_s:.2f} s"
    return f"run {run_id} preempted {where}{took}; `distlaunch up {spec_file} --resume` continues"


def headline(run_id: str, failure: Failure) -> str:
    """The one line that explains the failure: the task, how it ended, its exception's first line."""
    found = evidence_of(failure)
    cause = f": {found.first_line()}" if found else ""
    note = f" ({failure.note})" if failure.note else ""
    return f"run {run_id} failed: {failure.task} {failure.how} after {failure.elapsed_s:.1f} s{cause}{note}"


def details(failure: Failure) -> str:
    """The evidence under the headline: a known failure's hint, then the exception condensed
    (first frame, last frame, first and last lines of the message), else the log's last lines."""
    found = evidence_of(failure)
    hint = hints.find(found)
    out = [f"  hint: {hint.text}"] if hint else []
    if failure.stacks:
        out.append(f"  where the tasks were (stacks in {failure.stacks_dir}):")
        out += [f"  | {evidence.clip(line)}" for line in failure.stacks]
    has_error_file = evidence.from_error_file(read_json(Path(failure.error_file))) is not None
    source = failure.error_file if has_error_file else failure.log_file
    if found is not None:
        # The log relative to the folder it shares with the error file (the run dir): two full
        # run-dir paths made this line hundreds of columns wide.
        run_dir = os.path.commonpath([failure.error_file, failure.log_file])
        log = os.path.relpath(failure.log_file, run_dir)
        full = f" (full text in {log})" if has_error_file else " (full text there)"
        out.append(f"  from {source}{full}:")
        out += [f"  | {line}" for line in found.condensed()]
        return "\n".join(out)
    body = tail(failure.log_file, TAIL_LINES, quiet_tf=True)
    if not body:
        return "\n".join([*out, f"  ({source} is empty)"])
    out.append(f"  from {source}:")
    out += [f"  | {evidence.clip(line)}" for line in body.splitlines()]
    return "\n".join(out)


def evidence_of(failure: Failure) -> evidence.Evidence | None:
    """The task's exception: from its error file, else from the traceback at the end of its log."""
    found = evidence.from_error_file(read_json(Path(failure.error_file)))
    return found or evidence.from_log(tail(failure.log_file, LOG_SCAN_LINES, quiet_tf=True))


def tail(path: str, lines: int, quiet_tf: bool = False) -> str:
    """Return the last ``lines`` lines of a file (reads only its end); ``quiet_tf``: lines of
    TensorFlow's C++ start-up noise do not count (task logs keep its INFO lines)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read()
    except OSError:
        return ""
    if quiet_tf:
        data = hide_tf_noise(data if data.endswith(b"\n") else data + b"\n")
    return b"\n".join(data.splitlines()[-lines:]).decode("utf-8", "replace")
