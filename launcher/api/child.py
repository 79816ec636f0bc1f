"""The launcher process behind `distlaunch.launch`: `python -m distlaunch.launcher.api.child FD`.

The supervisor must own a main thread (its signal handlers, the tasks' parent-death signal), so a
run started from Python gets a launcher process of its own, which does what `distlaunch up` does
with the same functions (load_spec, choose_run, up.claim_and_up). It reads the caller's request
on stdin and answers on fd FD (launcher/api/protocol.py) before anything starts; then its output
(the tasks' prefixed lines and the launcher's messages) goes to its stdout, which the caller
reads. The caller's end (its process, watched with a pidfd: a pipe's EOF would wait for every
process forked from the caller, which inherit its end) or EOF on stdin (the caller closed it)
stops the run as a stop notice does (`distlaunch down`: a save, then every task TERM, grace,
KILL).

Exit codes are the CLI's: 0, 1 a task failed, 2 bad spec or usage or host, 128+N signal N.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from distlaunch.launcher.api import protocol as api_protocol
from distlaunch.launcher.cli import exit_code
from distlaunch.launcher.control.down import LAUNCHER_SLACK_S
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


def _move_files(files: dict[str, str]) -> Any:
    def move(run_dir: Path) -> None:
        for relative, source in files.items():
            path = run_dir / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(source, path)  # a rename on the same file system
            os.chmod(path, rundir.file_mode(path.parent))

    return move


def _discard(files: dict[str, str]) -> None:
    """Remove the request's files that were not moved into the run dir (a refused run, or one
    stopped before its tasks started): they are this run's alone."""
    for source in files.values():
        Path(source).unlink(missing_ok=True)


def _stop_when_stdin_closes() -> None:
    """EOF on stdin: the caller closed the pipe. Stop the run as SIGTERM would."""
    try:
        while sys.stdin.buffer.read(1 << 16):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def _stop_when_caller_ends(pidfd: int) -> None:
    """The caller's process ended (a pidfd turns readable): stop the run as SIGTERM would."""
    select.select([pidfd], [], [])
    os.kill(os.getpid(), signal.SIGTERM)


def _watch_caller(pid: int) -> None:
    """Stop the run when the caller ``pid`` ends; at once if it has ended already (this
    process was then handed to another parent)."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:  # gone already
        pidfd = None
    # Checked once the pidfd is held: it is then the caller's, not a process that took its pid.
    if pidfd is None or os.getppid() != pid:
        os.kill(os.getpid(), signal.SIGTERM)
        return
    threading.Thread(target=_stop_when_caller_ends, args=(pidfd,), daemon=True).start()


def main(reply_fd: int) -> int:
    """Answer the request on stdin on ``reply_fd``, then run it to its end; return the exit
    code."""
    line = sys.stdin.buffer.readline()
    if not line:
        return 0  # the caller went before asking anything
    request = json.loads(line)
    threading.Thread(target=_stop_when_stdin_closes, daemon=True).start()
    _watch_caller(request["caller_pid"])
    out = sys.stdout.buffer
    with os.fdopen(reply_fd, "wb") as reply:
        try:
            loaded = load(request)
            target = choose_run(loaded, request["run_id"], request["resume"])
        except LaunchError as exc:
            _discard(request["files"])
            reply.write(api_protocol.refused(exc))
            return exit_code(exc)
        timeouts = loaded.spec.timeouts
        stop_now_s = timeouts.grace_s + LAUNCHER_SLACK_S  # as `distlaunch down` counts
        reply.write(
            api_protocol.accepted(
                target.run_id, str(target.run_dir), timeouts.save_s + stop_now_s, stop_now_s
            )
        )
    try:
        console = Console(out, out, color=False, quiet_tf=loaded.spec.tf_log_level == "default")
        files = _move_files(request["files"])
        claim_and_up(loaded, target, console, before_start=files)
    except LaunchError as exc:
        if not isinstance(exc, RunFailed):  # its summary is printed already
            out.write(f"distlaunch: error: {exc}\n".encode())
        out.flush()
        return exit_code(exc)
    finally:
        _discard(request["files"])  # not moved: stopped before any task started
    out.flush()
    return 0


if __name__ == "__main__":
    code = main(int(sys.argv[1]))
    # As the CLI: every task is gone and every record written; the echo drains in the atexit
    # handlers, then the interpreter's teardown is skipped.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    os._exit(code)
