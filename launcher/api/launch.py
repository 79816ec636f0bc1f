"""`distlaunch.launch` and `distlaunch.up`: a cluster spec started from Python, and its `Run` handle.

The run is supervised by a launcher process of its own (launcher/api/child.py: the supervisor
needs a main thread), which loads the spec and chooses the run as `distlaunch up` does and
answers before anything starts (launcher/api/protocol.py): a bad spec raises SpecError here, a
bad run id UsageError, with the CLI's one line. This side imports none of the launcher's heavy
modules to start a run (the first call of a session pays for them once, in that process); it
reads the run (api_reads) while the launcher starts. The launcher lives no longer than the
caller: it watches this process itself (a pidfd), so the caller's exit, even a SIGKILL, stops
the run, whatever processes forked from the caller still live. Its output is read by a thread
here and written to the caller's ``console`` (sys.stdout by default, looked up at each write: a
notebook's cell, pytest's capture).

Interrupts and fork: a run is held from the moment its launcher process exists. A Ctrl-C while
its launcher answers stops it (and `owning` stops what an interrupted API call started before
it could hand it back). A forked process (multiprocessing's default on Linux) starts with no
run of its parent's: it stops none of them, at its exit or ever.

Stops from here give the launcher the deadline `distlaunch down` gives it: with a save,
timeouts.save_s + grace_s + the launcher's slack; without, grace_s + the slack.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO

from distlaunch.launcher.api import protocol as api_protocol
from distlaunch.launcher.api.results import RunFailed, RunResult, StartError
from distlaunch.launcher.run.options import DEFAULTS, LaunchOptions, SpecInput

__all__ = ["LaunchOptions", "Run", "SpecInput", "launch", "up"]

if TYPE_CHECKING:
    from types import ModuleType

    from distlaunch.launcher.spec.model import Spec

# Where a run's output goes: "stdout" (sys.stdout at each write), a text stream, or None (the
# run dir only).
ConsoleTarget = Literal["stdout"] | TextIO | None
# After the launcher process exits, how long its output may still take to arrive.
_DRAIN_S = 5.0
# How long `stop` waits for a launcher that has not answered yet (it did not say its deadlines):
# the defaults of timeouts.save_s and grace_s, and `down`'s slack.
_UNANSWERED_STOP_S = 30.0 + 5.0 + 10.0

# What the launcher process exits with when it could not start the run (the CLI's usage exit).
START_ERROR_EXIT = 2

_live: set[Run] = set()  # runs whose launcher may still run: stopped at the caller's exit
# Runs inherited from the parent in a forked process: never used, never stopped there.
_inherited: list[Run] = []
# The runs each thread started inside `owning` blocks.
_owned = threading.local()


class Run:
    """A run started by `launch`: its state, tasks and logs while it runs, and its result."""

    def __init__(self, request: bytes, console: ConsoleTarget) -> None:
        """Start the launcher process with ``request`` and wait for its answer; raise what it
        refused the run with (SpecError, UsageError, StartError)."""
        self.console = console  # where task lines go; the pool sets it per call
        self._errors: list[str] = []  # the launcher's `distlaunch: error:` lines
        self._result: RunResult | None = None
        self._lock = threading.Lock()
        self.last_output = time.monotonic()  # when the last line of its output arrived
        # The launcher's deadlines for a stop with a save and without (it says them).
        self._stop_s = (_UNANSWERED_STOP_S, _UNANSWERED_STOP_S)
        reply_r, reply_w = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "distlaunch.launcher.api.child", str(reply_w)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(reply_w,),
                # A Ctrl-C in the caller's terminal reaches the caller only; it stops the run.
                start_new_session=True,
            )
        finally:
            os.close(reply_w)
        _live.add(self)
        runs = getattr(_owned, "runs", None)
        if runs is not None:
            runs.append(self)
        self._reader = threading.Thread(target=self._echo, name="distlaunch-run", daemon=True)
        replies = os.fdopen(reply_r, "rb")
        try:
            assert self._proc.stdin is not None
            self._proc.stdin.write(request)
            self._proc.stdin.flush()  # kept open: EOF also tells the launcher its caller is gone
            self._reader.start()
            # While the launcher starts (its imports), this process imports what it reads later.
            reads()
            with replies:
                line = replies.readline()
        except BaseException:
            # Interrupted (Ctrl-C) while the launcher answers: it may have the request already,
            # and no one else holds this run. Stopped at once.
            replies.close()
            self._abandon()
            raise
        reply = json.loads(line) if line else {"event": "gone"}
        if reply["event"] != "accepted":
            self._proc.wait()
            self._finish()
            if reply["event"] == "refused":
                raise api_protocol.refusal_error(reply)
            raise StartError(self.error_line or f"the launcher exited with {self._proc.returncode}")
        self.run_id: str = reply["run_id"]
        self.run_dir = Path(reply["run_dir"])
        self._stop_s = (float(reply["stop_s"]), float(reply["stop_now_s"]))

    def __repr__(self) -> str:
        return f"<distlaunch.Run {self.run_id} {self.state}>"

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *_exc: object) -> None:
        """Leaving the block stops the run if it still runs."""
        self.stop()

    @property
    def state(self) -> str:
        """The run's state: "starting" (no run.json yet), "running", "stopping", "succeeded",
        "failed", "interrupted", or "lost" (its launcher died)."""
        if self._result is not None:
            return self._result.state
        return reads().state_of(self.run_dir)

    @property
    def alive(self) -> bool:
        """Whether the run's launcher still runs (the run has not ended)."""
        return self._proc.poll() is None

    @property
    def result(self) -> RunResult | None:
        """How the run ended; None while it runs."""
        if self._result is None and self._proc.poll() is not None:
            self._finish()
        return self._result

    @property
    def tasks(self) -> list[dict[str, Any]]:
        """One row per task, as `distlaunch status --json` lists them (task, state, pid, port,
        attempt, restarts, uptime_s, exit); empty before the run has started."""
        return reads().task_rows(self.run_dir)

    def logs(self, task: str) -> str:
        """The log of ``task`` (``worker-1`` or ``worker:1``) in its latest attempt ("" before it
        started); UsageError for a task the run does not have."""
        return reads().log_text(self.run_dir, task)

    def restart(self, task: str) -> str:
        """Restart ``task`` the way its strategy needs (an MWMS task restarts the gang), outside
        the restart budget, as `distlaunch restart` does; return its name."""
        return reads().restart(self.run_dir, task)

    def report(self) -> Path:
        """Write the run's report.html (as `distlaunch report` does: a timeline of every task's
        attempts and the loss and steps/s over time; a running run's so far) and return its
        path."""
        from distlaunch.launcher.report.write import write_report

        return write_report(self.run_dir)

    def _repr_html_(self) -> str | None:
        """In a notebook, the run shows as its report (nothing is written); before its run.json
        exists, as its repr."""
        from distlaunch.launcher.core.errors import UsageError
        from distlaunch.launcher.report.write import inline_html

        try:
            return inline_html(self.run_dir)
        except UsageError:
            return None

    def wait(self, timeout: float | None = None) -> RunResult:
        """Wait for the run to end and return its result; TimeoutError after ``timeout`` seconds
        (the run goes on)."""
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"run {self.run_id} still runs after {timeout:g} s") from None
        return self._finish()

    def stop(self, save: bool = True) -> RunResult:
        """Stop the run and return its result, as `distlaunch down` does: with ``save`` a
        program that saves on a stop notice saves first (timeouts.save_s; docs/preemption.md)
        and the run ends preempted, resumable where it saved; ``save=False`` stops at once, as
        `down --now` does. Then every task TERM, grace, KILL. The launcher gets the deadline
        `down` gives it (timeouts.save_s + grace_s and its slack; without the save, grace_s and
        the slack), then is killed with its tasks. A run that has ended only returns its
        result."""
        if self._proc.poll() is None:
            try:
                # The launcher's stop notice, or the signal that stops it at once (Ctrl-C's).
                self._proc.send_signal(signal.SIGTERM if save else signal.SIGINT)
            except ProcessLookupError:
                pass
            try:
                self._proc.wait(self._stop_s[0] if save else self._stop_s[1])
            except subprocess.TimeoutExpired:
                # A launcher that does not stop in time: closing its stdin is its last word...
                self._proc.kill()  # ...and its tasks die with it (their parent-death signal)
                self._proc.wait()
        return self._finish()

    # ---- internals ----------------------------------------------------------------------------

    def _abandon(self) -> None:
        """Stop a launcher whose answer was not read (an interrupt): at once, as `down --now`;
        killed with its tasks when it does not end in time."""
        try:
            self._proc.send_signal(signal.SIGINT)
            try:
                self._proc.wait(self._stop_s[1])
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        finally:
            self._finish()

    def _echo(self) -> None:
        """Copy the launcher's output, line by line, to the console; keep its error lines."""
        in_error = False
        for raw in self._lines():
            self.last_output = time.monotonic()
            line = raw.decode("utf-8", "replace")
            if line.startswith("distlaunch: error: "):
                self._errors.append(line.rstrip("\n").removeprefix("distlaunch: error: "))
                in_error = True
            elif in_error and line.startswith("  "):  # a HostError's line per host
                self._errors[-1] += "\n" + line.rstrip("\n")
            else:
                in_error = False
            target = sys.stdout if self.console == "stdout" else self.console
            if target is None:
                continue
            try:
                target.write(line)
                target.flush()
            except (OSError, ValueError):
                pass  # a console that is closed: the run dir has every line

    def _lines(self) -> Iterator[bytes]:
        """The launcher's output, line by line (the last one perhaps without its newline), read
        from its pipe with os.read: a buffered reader's lock, held by this thread while it
        waits, would be held for good in a process forked meanwhile."""
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        partial = b""
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                if partial:
                    yield partial
                return
            lines = (partial + chunk).split(b"\n")
            partial = lines.pop()
            for line in lines:
                yield line + b"\n"

    def _finish(self) -> RunResult:
        with self._lock:
            if self._result is None:
                if self._reader.ident is not None:  # started (not when interrupted before)
                    self._reader.join(_DRAIN_S)
                run_dir = getattr(self, "run_dir", None)  # None: the launcher refused the run
                self._result = reads().result_of(run_dir, self._proc.returncode)
                if self._proc.stdin is not None:
                    self._proc.stdin.close()
                if self._proc.stdout is not None and not self._reader.is_alive():
                    self._proc.stdout.close()
                _live.discard(self)
        return self._result

    @property
    def error_line(self) -> str | None:
        """The launcher's own error, as the CLI prints it, when it could not run the spec (a
        host that failed its check: a line under it per host; a sandbox that cannot be made):
        nothing was started."""
        return self._errors[-1] if self._errors else None


def launch(
    spec: SpecInput,
    *,
    backend: str | None = DEFAULTS.backend,
    run_id: str | None = DEFAULTS.run_id,
    resume: bool = DEFAULTS.resume,
    overrides: tuple[str, ...] | list[str] = DEFAULTS.overrides,
    console: ConsoleTarget = "stdout",
) -> Run:
    """Start ``spec`` as `distlaunch up` does and return its `Run` at once.

    ``spec``: a spec file's path, the spec as a dict (relative paths against the working
    directory), or a typed ``Spec``. ``backend``, ``run_id``, ``resume`` and ``overrides`` are
    `LaunchOptions`' fields, as `distlaunch up` takes them. ``console``: where the tasks'
    prefixed lines and the launcher's messages go (default sys.stdout; None: the run dir only).
    A bad spec raises SpecError, a bad run id UsageError: nothing starts.
    """
    options = LaunchOptions(
        spec=spec, backend=backend, run_id=run_id, resume=resume, overrides=tuple(overrides)
    )
    return launch_with_files(options, console, {})


def up(
    spec: SpecInput,
    *,
    backend: str | None = DEFAULTS.backend,
    run_id: str | None = DEFAULTS.run_id,
    resume: bool = DEFAULTS.resume,
    overrides: tuple[str, ...] | list[str] = DEFAULTS.overrides,
    console: ConsoleTarget = "stdout",
) -> RunResult:
    """`launch`, then wait for the end: return the result of a run that succeeded, else raise
    RunFailed carrying it (its root-cause failure as data). An interrupt (Ctrl-C) stops the run
    first."""
    with owning():
        run = launch(
            spec,
            backend=backend,
            run_id=run_id,
            resume=resume,
            overrides=overrides,
            console=console,
        )
        return check(run, wait(run))


def wait(run: Run) -> RunResult:
    """``run.wait()``; whatever interrupts the wait (Ctrl-C, a test's timeout) stops the run."""
    try:
        return run.wait()
    except BaseException:
        stop_interrupted(run)
        raise


def stop_interrupted(run: Run) -> RunResult:
    """Stop ``run`` because its caller was interrupted, as `Run.stop` does (the launcher's
    deadline is `down`'s), without echoing the launcher's own words for it ("interrupted by
    SIGTERM": the signal it got from here): the caller's KeyboardInterrupt says what happened,
    and the run dir keeps every line."""
    run.console = None
    return run.stop()


@contextlib.contextmanager
def owning() -> Iterator[None]:
    """Hold every run this thread starts inside the block: an interrupt leaving it (Ctrl-C,
    a test's timeout: any exception that is not an ``Exception``), whenever it comes, stops each
    of them that still runs, as `Run.stop` does, before it goes on up."""
    outer = getattr(_owned, "runs", None)
    runs: list[Run] = []
    _owned.runs = runs
    try:
        yield
    except Exception:
        raise
    except BaseException:
        for run in runs:
            try:
                stop_interrupted(run)
            except Exception:  # noqa: BLE001 - each run gets its stop, whatever the others did
                pass
        raise
    finally:
        _owned.runs = outer
        if outer is not None:
            outer.extend(runs)


def check(run: Run, result: RunResult) -> RunResult:
    """``result`` if the run succeeded; else RunFailed with the line the CLI would print, or
    StartError when the launcher could not start it."""
    if result.ok:
        return result
    if result.failure is not None:
        raise RunFailed(result.failure.summary, result, str(run.run_dir))
    line = run.error_line or f"run {run.run_id} {result.state} (exit code {result.exit_code})"
    if result.exit_code == START_ERROR_EXIT:
        raise StartError(line)
    raise RunFailed(line, result, str(run.run_dir))


def launch_with_files(
    options: LaunchOptions, console: ConsoleTarget, files: Mapping[str, Path]
) -> Run:
    """`launch` of ``options.spec`` (the spec options: backend, run_id, resume, overrides),
    also moving ``files`` (relative path in the run dir: a file of this machine) into the run
    dir before any task starts (`distlaunch.run`'s payload: it travels as a file, never inside
    the request)."""
    spec = options.spec
    if isinstance(spec, str | os.PathLike):
        spec_file, spec_data = os.fspath(spec), None
    elif isinstance(spec, Mapping):
        spec_file, spec_data = None, dict(spec)
    elif hasattr(spec, "model_dump"):  # the typed Spec (not imported here: the caller's start)
        spec_file, spec_data = None, spec_as_data(spec)
    else:
        raise TypeError(f"expected a spec path, dict or Spec, got a {type(spec).__name__}")
    request = api_protocol.request_line(
        spec_file=spec_file,
        spec_data=spec_data,
        base=os.getcwd(),
        overrides=options.spec_overrides,
        run_id=options.run_id,
        resume=options.resume,
        files={relative: str(source) for relative, source in files.items()},
    )
    return Run(request, console)


def spec_as_data(spec: Spec) -> dict[str, Any]:
    """A typed spec as the data it validates from (what the launcher process is sent): the
    values that were set, as written."""
    return spec.model_dump(mode="json", exclude_unset=True)


def reads() -> ModuleType:
    """launcher/api/reads.py, imported on first use: it reads run.json and logs with the
    launcher's modules, heavier than this one's."""
    return importlib.import_module("distlaunch.launcher.api.reads")


def _after_fork_in_child() -> None:
    """A forked process holds none of its parent's runs: it neither stops them at its exit nor
    waits on their launchers (not its children) or their echo threads' locks."""
    global _owned
    _inherited.extend(_live)
    _live.clear()
    _owned = threading.local()


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _stop_live_runs() -> None:
    """The caller is exiting: stop every run it started that still runs (no orphan tasks)."""
    for run in list(_live):
        try:
            run.stop()
        except Exception:  # noqa: BLE001 - each run gets its stop, whatever the others did
            pass
