"""A pod's PID 1: runs the task's program, turns the pod's SIGTERM into a stop notice, reaps.

Kubernetes stops a pod (a drain, an eviction, a preemption, a deleted Job) by sending SIGTERM to
the container's PID 1 and SIGKILL after terminationGracePeriodSeconds. A program run as PID 1
gets no default action from the kernel: a SIGTERM it has no handler for is dropped, and the pod
dies of SIGKILL at the end of the grace period. So the entrypoint (k8s_entry) stays in between
as PID 1: the program runs in a process group of its own, and the SIGTERM goes where the spec's
program needs it, as the local supervisor sends its notice (``Notice``):

- PROGRAM (a program that saves on a notice: program_scan's saves_on_notice; PSS: the chief):
  SIGTERM to the program's process alone, never to its children (a data loader's workers), as
  taskinit's NOTICE does. While the program builds its strategy TensorFlow's own handler
  swallows SIGTERM (worker/preempt.py): a notice that came before the program's status file
  said it was built (state past "starting") is sent again once it does.
- CHIEF (PSS ps and worker servers of such a program): nothing at first; the chief's steps need
  them until it has saved. Once the chief's status file (on the run's shared volume) reports
  "preempted", or ``save_s`` after the notice, the server's process group gets SIGTERM.
- GROUP (a program that cannot save, the evaluator): SIGTERM to the process group, a stop as
  before.

The pod's exit code is the program's, read by contract.EXIT_CODES where Kubernetes cannot: a
code that means "preempted" only after a notice (42, 143) becomes EXIT_PREEMPTED when the pod had
one, so that the manifest's podFailurePolicy, which sees exit codes only, restarts it without
counting a failure (launcher/export/k8s.py); a server stopped after its chief saved exits
EXIT_PREEMPTED too. Death by signal N is exit 128+N (a PID 1 cannot die of its own signal).
SIGINT and SIGHUP go to the process group. Orphans re-parented to PID 1 are reaped. Standard
library only.
"""

from __future__ import annotations

import enum
import json
import os
import signal
import time
from pathlib import Path

from distlaunch.worker import contract

# How often, while a notice waits on a status file, that file is read again.
POLL_S = 0.25
_HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD)


class Notice(enum.StrEnum):
    """Where the pod's SIGTERM goes (see the module docstring)."""

    PROGRAM = "program"
    CHIEF = "chief"
    GROUP = "group"


def exit_code(status: int, noticed: bool, chief_saved: bool) -> int:
    """The pod's exit code for the program's wait ``status`` (see the module docstring)."""
    code = os.waitstatus_to_exitcode(status)
    if chief_saved or (code > 0 and noticed and _preempted(code)):
        return contract.EXIT_PREEMPTED
    return 128 - code if code < 0 else code


def _preempted(code: int) -> bool:
    return contract.exit_meaning(code, noticed=True) == contract.ExitMeaning.PREEMPTED


def run(
    program: list[str], notice: Notice, status: Path | None, chief: Path | None, save_s: float
) -> int:
    """Run ``program`` until it exits and return the pod's exit code. ``status``: the program's
    status file; ``chief``: the chief's (CHIEF); ``save_s``: the chief's deadline (CHIEF)."""
    started = time.time()
    signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED)
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        try:
            os.execvp(program[0], program)
        except OSError as exc:
            os.write(2, f"distlaunch: cannot run {program[0]}: {exc.strerror}\n".encode())
            os._exit(127 if isinstance(exc, FileNotFoundError) else 126)
    try:
        os.setpgid(pid, pid)  # also here: a signal to pass on must find the group at once
    except OSError:
        pass  # the child did it and exec'd already, or has exited
    noticed_at: float | None = None  # time.monotonic() of the notice
    again = False  # a notice to send again once the program's strategy is built
    chief_before: dict = {}  # the chief's status when the notice came (CHIEF)
    hold_until: float | None = None  # a server serves until its chief saved, or then (CHIEF)
    chief_saved = False
    while True:
        ended = _reap(pid)
        if ended is not None:
            return exit_code(ended, noticed_at is not None, chief_saved)
        polling = again or hold_until is not None
        got = signal.sigtimedwait(_HANDLED, POLL_S if polling else 3600)
        if got is not None and got.si_signo == signal.SIGTERM and noticed_at is None:
            noticed_at = time.monotonic()
            if notice == Notice.PROGRAM:
                # Read before sending: a strategy built in between gets the notice twice, which
                # changes nothing (worker/preempt.py), rather than not at all.
                again = not _built(status, started)
                _kill(pid, signal.SIGTERM)
            elif notice == Notice.CHIEF:
                chief_before, hold_until = _read(chief), noticed_at + save_s
            else:
                _kill(-pid, signal.SIGTERM)
            # Once it is acted on: what the chief's status was is known by then.
            print(f"distlaunch: SIGTERM: a stop notice ({notice})", flush=True)
        elif got is not None and got.si_signo != signal.SIGCHLD:
            _kill(-pid, got.si_signo)  # a second SIGTERM, SIGINT, SIGHUP: a stop
        if again and _built(status, started):
            again = False
            _kill(pid, signal.SIGTERM)
        if hold_until is not None:
            now = _read(chief)
            chief_saved = now.get("state") == contract.STATE_PREEMPTED and now != chief_before
            if chief_saved or time.monotonic() >= hold_until:
                hold_until = None
                how = "saved" if chief_saved else f"did not save within {save_s:g} s"
                print(f"distlaunch: the chief {how}: this server stops", flush=True)
                _kill(-pid, signal.SIGTERM)


def _reap(pid: int) -> int | None:
    """Reap every exited child (orphans come to PID 1); the program's wait status once it ended."""
    found = None
    while True:
        try:
            child, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return found
        if child == 0:
            return found
        if child == pid:
            found = status


def _built(status: Path | None, started: float) -> bool:
    """Whether this pod's program has built its strategy (its status, written since ``started``,
    is past "starting"); True without a status file: nothing would tell."""
    if status is None:
        return True
    data = _read(status)
    return data.get("time", 0) >= started and data.get("state") not in (
        None,
        contract.STATE_STARTING,
    )


def _read(path: Path | None) -> dict:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
