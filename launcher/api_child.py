"""The launcher process behind `distlaunch.launch`: `python -m distlaunch.launcher.api_child`.

The supervisor must own a main thread (its signal handlers, the tasks' parent-death signal), so a
run started from Python gets a launcher process of its own, which does what `distlaunch up` does
with the same functions (load_spec, choose_run, up.claim_and_up). The caller writes one JSON line
on its stdin (the request below) and keeps the pipe open: EOF means the caller is gone, and the
run is stopped as on SIGTERM (every task TERM, grace, KILL). Its output (the tasks' prefixed
lines and the launcher's messages) goes to its stdout, which the caller reads.

Exit codes are the CLI's: 0, 1 a task failed, 2 bad spec or usage or host, 128+N signal N.
"""

from __future__ import annotations

import atexit
import base64
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from distlaunch.launcher import rundir
from distlaunch.launcher.cli import exit_code
from distlaunch.launcher.console import Console
from distlaunch.launcher.errors import LaunchError, RunFailed
from distlaunch.launcher.spec import LoadedSpec, load_spec, load_spec_data
from distlaunch.launcher.spec_sources import SpecOptions
from distlaunch.launcher.up import choose_run, claim_and_up


def request_line(
    *,
    spec_file: str | None,
    spec_data: dict[str, Any] | None,
    base: str,
    overrides: tuple[str, ...],
    run_id: str,
    files: dict[str, bytes] | None = None,
) -> bytes:
    """The request the caller sends: the spec (a file, or data with relative paths against
    ``base``), its overrides, the run to start or resume, and files to put in the run dir
    (relative paths) before any task starts."""
    data = {
        "spec_file": spec_file,
        "spec_data": spec_data,
        "base": base,
        "overrides": list(overrides),
        "run_id": run_id,
        "files": {k: base64.b64encode(v).decode() for k, v in (files or {}).items()},
    }
    return json.dumps(data).encode() + b"\n"


def load(request: dict[str, Any]) -> LoadedSpec:
    """The spec a request names, loaded as the CLI loads one."""
    options = SpecOptions(overrides=tuple(request["overrides"]))
    if request["spec_file"] is not None:
        return load_spec(request["spec_file"], options)
    return load_spec_data(request["spec_data"], Path(request["base"]), DATA_NAME, options)


# What errors in a spec given as data name in place of a file.
DATA_NAME = "<spec>"


def _write_files(files: dict[str, str]) -> Any:
    def write(run_dir: Path) -> None:
        for relative, encoded in files.items():
            path = run_dir / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            rundir.create_file(path)  # with the run dir's file mode
            path.write_bytes(base64.b64decode(encoded))

    return write


def _stop_when_caller_goes() -> None:
    """EOF on stdin: the caller closed the pipe or died. Stop the run as SIGTERM would."""
    try:
        while sys.stdin.buffer.read(1 << 16):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    """Run the request on stdin to its end; return the exit code."""
    request = json.loads(sys.stdin.buffer.readline())
    threading.Thread(target=_stop_when_caller_goes, daemon=True).start()
    out = sys.stdout.buffer
    try:
        loaded = load(request)
        console = Console(out, out, color=False, quiet_tf=loaded.spec.tf_log_level == "default")
        target = choose_run(loaded, request["run_id"], False)
        claim_and_up(loaded, target, console, before_start=_write_files(request["files"]))
    except LaunchError as exc:
        if not isinstance(exc, RunFailed):  # its summary is printed already
            out.write(f"distlaunch: error: {exc}\n".encode())
        out.flush()
        return exit_code(exc)
    out.flush()
    return 0


if __name__ == "__main__":
    code = main()
    # As the CLI: every task is gone and every record written; the echo drains in the atexit
    # handlers, then the interpreter's teardown is skipped.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    os._exit(code)
