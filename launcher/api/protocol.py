"""What the Python API's caller and its launcher process (api_child) say to each other.

The caller writes one request line on the launcher's stdin (and keeps the pipe open: EOF means
the caller is gone). The launcher loads the spec and chooses the run, then answers one line on
its reply pipe: accepted (the run's id, dir and grace) or refused (the error, typed, with the
CLI's text; nothing was started). Everything after that is the launcher's output and run.json.

This module imports nothing heavy: the caller side of the API stays as light as the standard
library and cloudpickle, and the launcher's own imports happen in its process.
"""

from __future__ import annotations

import base64
import json
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
    files: dict[str, bytes],
) -> bytes:
    """The request: the spec (a file, or data with relative paths against ``base``), its
    overrides, the run to start or resume (as `up --run-id/--resume` choose it), and files to
    put in the run dir (relative paths) before any task starts."""
    data = {
        "spec_file": spec_file,
        "spec_data": spec_data,
        "base": base,
        "overrides": list(overrides),
        "run_id": run_id,
        "resume": resume,
        "files": {k: base64.b64encode(v).decode() for k, v in files.items()},
    }
    return json.dumps(data).encode() + b"\n"


def files_of(request: dict[str, Any]) -> dict[str, bytes]:
    """The files a request carries, by relative path."""
    return {k: base64.b64decode(v) for k, v in request["files"].items()}


def accepted(run_id: str, run_dir: str, grace_s: float) -> bytes:
    """The reply of a launcher that is starting the run."""
    data = {"event": "accepted", "run_id": run_id, "run_dir": run_dir, "grace_s": grace_s}
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
