"""What a `distlaunch.Run` reads about its run, from outside the launcher: its state and task
rows (run.json, as `distlaunch status` shows them), a task's log, a restart request (as
`distlaunch restart` makes it), and once it ended its result with the root-cause failure as data.

Imported by launcher/api/launch.py on first use, while the launcher process starts: these modules
are the launcher's own, heavier than what the caller needs to start a run.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from distlaunch.launcher.api.results import Failure, FailureKind, RunResult, failure_kind
from distlaunch.launcher.control import logs as control_logs
from distlaunch.launcher.control.requests import request_restart
from distlaunch.launcher.control.status import run_state, status_rows
from distlaunch.launcher.diagnosis import evidence, oom
from distlaunch.launcher.diagnosis.summary import LOG_SCAN_LINES, tail
from distlaunch.launcher.record import rundir
from distlaunch.launcher.record.endings import EventKind
from distlaunch.launcher.record.state import RunFailure, RunRecord
from distlaunch.worker import contract


def state_of(run_dir: Path) -> str:
    """The run's state as `status` shows it; "starting" before its run.json exists."""
    record = RunRecord.find(run_dir)
    return run_state(record) if record is not None else "starting"


def task_rows(run_dir: Path) -> list[dict[str, Any]]:
    """`distlaunch status --json`'s task rows; none before the run has started."""
    record = RunRecord.find(run_dir)
    return status_rows(record) if record is not None else []


def log_text(run_dir: Path, task: str) -> str:
    """The log of ``task`` in its latest attempt ("" before it started); UsageError for a task
    the run does not have."""
    if RunRecord.find(run_dir) is None:
        return ""
    (path,) = control_logs.log_files(run_dir, task)
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def restart(run_dir: Path, task: str) -> str:
    """Ask the run's launcher to restart ``task``, as `distlaunch restart`; return its name."""
    return request_restart(run_dir, task)


def task_attempts(run_dir: Path) -> tuple[str, dict[str, tuple[str, int]]]:
    """The run's strategy, and each task's role and latest attempt, in TF_CONFIG order."""
    record = RunRecord.load(run_dir)
    return record.strategy, {n: (t.role, t.attempt) for n, t in record.tasks.items()}


def exit_code_of(run_dir: Path, task: str) -> int | None:
    """The exit code run.json records for ``task``'s latest attempt; None while it runs (or
    before run.json exists)."""
    record = RunRecord.find(run_dir)
    entry = record.tasks.get(task) if record is not None else None
    return entry.exit_code if entry is not None else None


def result_of(run_dir: Path | None, returncode: int) -> RunResult:
    """The result of the run whose launcher exited with ``returncode``, from its run.json (None:
    the launcher refused it)."""
    code = returncode if returncode >= 0 else 128 - returncode  # killed by a signal: 128+N
    record = RunRecord.find(run_dir) if run_dir is not None else None
    if record is None:  # it never started: stopped first (a signal), or the launcher's error
        return RunResult("interrupted" if code > 128 else "failed", code, None)
    return RunResult(run_state(record), code, failure_of(run_dir, record))


def failure_of(run_dir: Path, record: RunRecord) -> Failure | None:
    """The root-cause failure of a run, as data: run.json's failure with the task's exit and its
    exception from its error file (or the traceback at the end of its log)."""
    if not record.failure:
        return None
    name, how, summary = record.failure.task, record.failure.how, record.failure.summary
    task = record.tasks.get(name)
    if task is None:
        return Failure(_kind(record.failure, False), name, summary, how)
    error_file = contract.error_path(run_dir, task.attempt, task.role, task.index)
    error = rundir.read_json(error_file)
    exc_type = message = text = None
    if isinstance(error, dict) and error.get("type"):
        exc_type, message = str(error["type"]), str(error.get("message") or "")
        text = str(error.get("traceback") or "") or None
    else:
        log = tail(
            str(contract.log_path(run_dir, task.attempt, task.role, task.index)), LOG_SCAN_LINES
        )
        found = evidence.from_log(log)
        if found is not None:
            exc_type, message = found.type, found.message
            text = log[log.rfind(evidence.TRACEBACK_START) :]
    kind = _kind(record.failure, exc_type is not None)
    signal_name = None
    if kind is FailureKind.SIGNAL or (task.exit_code is not None and task.exit_code < 0):
        code = -(task.exit_code or 0)
        signal_name = how.removeprefix("signal ") if how.startswith("signal ") else _sig(code)
    return Failure(
        kind=kind,
        task=name,
        summary=summary,
        how=how,
        exit_code=task.exit_code if (task.exit_code or 0) >= 0 else None,
        signal=signal_name,
        exception_type=exc_type,
        message=message,
        traceback=text,
    )


# The API's kind of each ending that is not an exit.
_KINDS = {
    EventKind.HUNG: FailureKind.HANG,
    EventKind.STARTUP_TIMEOUT: FailureKind.STARTUP,
    EventKind.FORMATION: FailureKind.FORMATION,
    EventKind.RUN_TIMEOUT: FailureKind.TIMEOUT,
}


def _kind(failure: RunFailure, has_exception: bool) -> FailureKind:
    """The API's kind of a failure, from its recorded kind and exit code; a record written
    before they were recorded (version < 2) has only the supervisor's words."""
    if failure.kind is None:
        return failure_kind(failure.how, has_exception)
    if failure.kind in _KINDS:
        return _KINDS[failure.kind]
    if failure.kind is not EventKind.EXITED or failure.exit_code is None:
        return FailureKind.OTHER
    if failure.how.startswith(oom.WORDS):
        return FailureKind.OOM
    if failure.exit_code < 0:
        return FailureKind.SIGNAL
    return FailureKind.EXCEPTION if has_exception else FailureKind.EXIT


def _sig(number: int) -> str | None:
    try:
        return signal.Signals(number).name
    except ValueError:
        return None
