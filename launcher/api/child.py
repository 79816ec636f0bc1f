"""The launcher process behind `distlaunch.launch`: `python -m distlaunch.launcher.api.child FD`.

The supervisor must own a main thread (its signal handlers, the tasks' parent-death signal), so a
run started from Python gets a launcher process of its own, which does what `distlaunch up` does
with the same functions (load_spec, choose_run, up.claim_and_up). It reads the caller's request
on stdin and answers on fd FD (launcher/api/protocol.py) before anything starts; then its output
(the tasks' prefixed lines and the launcher's messages) goes to its stdout, which the caller
reads. EOF on stdin means the caller is gone (it closed the pipe, or died): the run is stopped as
on SIGTERM (every task TERM, grace, KILL).

Exit codes are the CLI's: 0, 1 a task failed, 2 bad spec or usage or host, 128+N signal N.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from distlaunch.launcher.api import protocol as api_protocol
from distlaunch.launcher.cli import exit_code
from distlaunch.launcher.core.console import Console
from distlaunch.launcher.core.errors import LaunchError, RunFailed
from distlaunch.launcher.record import rundir
from distlaunch.launcher.run.up import choose_run, claim_and_up
from distlaunch.launcher.spec.model import LoadedSpec, load_spec, load_spec_data
from distlaunch.launcher.spec.sources import SpecOptions


def load(request: dict[str, Any]) -> LoadedSpec:
    """The spec a request names, loaded as the CLI loads one."""
    options = SpecOptions(overrides=tuple(request["overrides"]))
    if request["spec_file"] is not None:
        return load_spec(request["spec_file"], options)
    return load_spec_data(
        request["spec_data"], Path(request["base"]), api_protocol.DATA_NAME, options
    )


def _write_files(files: dict[str, bytes]) -> Any:
    def write(run_dir: Path) -> None:
        for relative, data in files.items():
            path = run_dir / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            rundir.create_file(path)  # with the run dir's file mode
            path.write_bytes(data)

    return write


def _stop_when_caller_goes() -> None:
    """EOF on stdin: the caller closed the pipe or died. Stop the run as SIGTERM would."""
    try:
        while sys.stdin.buffer.read(1 << 16):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def main(reply_fd: int) -> int:
    """Answer the request on stdin on ``reply_fd``, then run it to its end; return the exit
    code."""
    line = sys.stdin.buffer.readline()
    if not line:
        return 0  # the caller went before asking anything
    request = json.loads(line)
    threading.Thread(target=_stop_when_caller_goes, daemon=True).start()
    out = sys.stdout.buffer
    with os.fdopen(reply_fd, "wb") as reply:
        try:
            loaded = load(request)
            target = choose_run(loaded, request["run_id"], request["resume"])
        except LaunchError as exc:
            reply.write(api_protocol.refused(exc))
            return exit_code(exc)
        grace_s = loaded.spec.timeouts.grace_s
        reply.write(api_protocol.accepted(target.run_id, str(target.run_dir), grace_s))
    try:
        console = Console(out, out, color=False, quiet_tf=loaded.spec.tf_log_level == "default")
        files = _write_files(api_protocol.files_of(request))
        claim_and_up(loaded, target, console, before_start=files)
    except LaunchError as exc:
        if not isinstance(exc, RunFailed):  # its summary is printed already
            out.write(f"distlaunch: error: {exc}\n".encode())
        out.flush()
        return exit_code(exc)
    out.flush()
    return 0


if __name__ == "__main__":
    code = main(int(sys.argv[1]))
    # As the CLI: every task is gone and every record written; the echo drains in the atexit
    # handlers, then the interpreter's teardown is skipped.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    os._exit(code)
