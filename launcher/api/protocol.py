"""What the Python API's caller and its launcher process (api_child) say to each other.

The caller writes one request line on the launcher's stdin (and keeps the pipe open: EOF means
the caller closed it). The request names the caller's process, which the launcher watches (a
pidfd): its end, even by SIGKILL while processes forked from it live on, stops the run. Files
for the run dir travel as paths of files the launcher moves there, never inside the line (a
large argument is never held as text). The launcher loads the spec and chooses the run, then
answers one line on its reply pipe: accepted (the run's id and dir, and the deadlines its stop
takes, as `distlaunch down` counts them) or refused (the error, typed, with the CLI's text;
nothing was started). Everything after that is the launcher's output and run.json.

This module imports nothing heavy: the caller side of the API stays as light as the standard
library and cloudpickle, and the launcher's own imports happen in its process.
"""

from __future__ import annotations

import json
import os
from typing import Any

from distlaunch.launcher.api.results import StartError
from distlaunch.launcher.core.errors import LaunchError, SpecError, UsageError

# What errors in a spec given as data name in place of a file.
DATA_NAME = "<spec>"


def request_line(
    *,
    spec_file: str | None,
    spec_data: dict[str, Any] | None,
    base: str,
    overrides: tuple[str, ...],
    run_id: str | None,
    resume: bool,
    files: dict[str, str],
) -> bytes:
    """The request: the spec (a file, or data with relative paths against ``base``), its
    overrides, the run to start or resume (as `up --run-id/--resume` choose it), files to move
    into the run dir (relative path: the file's path here) before any task starts, and this
    process (the caller the launcher watches)."""
    data = {
        "caller_pid": os.getpid(),
        "spec_file": spec_file,
        "spec_data": spec_data,
        "base": base,
        "overrides": list(overrides),
        "run_id": run_id,
        "resume": resume,
        "files": files,
    }
    return json.dumps(data).encode() + b"\n"


def accepted(run_id: str, run_dir: str, stop_s: float, stop_now_s: float) -> bytes:
    """The reply of a launcher that is starting the run: what it will be given to stop, with
    a save (``stop_s``) and without (``stop_now_s``), before it is killed."""
    data = {
        "event": "accepted",
        "run_id": run_id,
        "run_dir": run_dir,
        "stop_s": stop_s,
        "stop_now_s": stop_now_s,
    }
    return json.dumps(data).encode() + b"\n"


def refused(error: LaunchError) -> bytes:
    """The reply of a launcher that cannot start the run: ``error``, enough to raise it again."""
    data: dict[str, Any] = {"event": "refused", "type": type(error).__name__, "text": str(error)}
    if isinstance(error, SpecError):
        data.update(file=error.file, json_path=error.json_path, message=error.message)
    return json.dumps(data).encode() + b"\n"


def refusal_error(reply: dict[str, Any]) -> LaunchError:
    """The error a refused reply stands for: SpecError and UsageError as themselves, anything
    else as a StartError with its text."""
    if reply.get("type") == "SpecError":
        return SpecError(reply["file"], reply["json_path"], reply["message"])
    if reply.get("type") == "UsageError":
        return UsageError(reply["text"])
    return StartError(reply["text"])
