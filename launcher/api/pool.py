"""The warm pool of `distlaunch.run`: later calls in one Python process reuse the tasks (and the
TensorFlow import) of an earlier call of the same shape.

An entry of the pool is a live run, started by `launch` as any call's run is (the same spec
validation, isolation and supervision), whose tasks serve call after call (worker/call.py
--serve; under ParameterServerStrategy the chief, the ps and worker tasks serving on). Call N
writes its payload into the run dir and N into each task's wake FIFO; each task runs the function and prints `distlaunch.run: call N done`, which the
run's echo swallows here and counts. A call that fails ends its task, so the run fails as a
one-shot run does; the caller gets the same error from the run's result and the entry is dropped.

One entry at most: a call of another shape (counts, strategy, env, working directory) stops it
and starts its own; a call made while the entry serves another call (from another thread) runs
one-shot. The entry is a `Run`, so it lives no longer than this process: stopped at exit, and on
a SIGKILL its launcher sees its stdin close and stops every task.
"""

from __future__ import annotations

import atexit
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

from distlaunch.launcher.api import launch as api
from distlaunch.launcher.api.results import RunResult
from distlaunch.worker.call import CLOSE, DONE, payload_path, wake_path

# The off switch: DISTLAUNCH_POOL=0 makes every call one-shot (the `pool=` argument wins).
POOL_ENV = "DISTLAUNCH_POOL"
_OFF = ("0", "false", "no", "off")
# How often a waiting call looks whether its run has ended (a task failed): the tasks' own
# lines wake it as soon as they arrive.
_CHECK_S = 0.2
# A serving task's `call N done` line as the run's output shows it, after the task's prefix.
_DONE_LINE = re.compile(r"^(\S+) +\| " + re.escape(DONE).replace(r"\{\}", r"(\d+)") + r"\n?$")


def enabled(pool: bool | None) -> bool:
    """Whether a call uses the pool: ``pool`` if given, else DISTLAUNCH_POOL (on unless 0)."""
    if pool is not None:
        return pool
    return os.environ.get(POOL_ENV, "1").strip().lower() not in _OFF


class _Entry:
    """A live run whose tasks serve calls, and which task has finished which call."""

    def __init__(self, key: str, run: api.Run, tasks: tuple[str, ...]) -> None:
        self.key, self.run, self.tasks = key, run, tasks
        self.calls = 1  # call 0 is the run's own payload
        self.busy = True
        self.done: dict[int, set[str]] = {}
        self.changed = threading.Condition()
        run.line_hook = self._hook

    def _hook(self, line: str) -> bool:
        """Count (and hide) a task's `call N done` line."""
        found = _DONE_LINE.match(line)
        if found is None:
            return False
        with self.changed:
            self.done.setdefault(int(found[2]), set()).add(found[1])
            self.changed.notify_all()
        return True


# How long a closing entry's tasks may take to return before their run is stopped.
_CLOSE_S = 30.0
_lock = threading.Lock()
_entry: _Entry | None = None


class Lease:
    """One call on the pool's entry: its number, and the wait for its end."""

    def __init__(self, entry: _Entry, number: int) -> None:
        self._entry = entry
        self.number = number
        self.run = entry.run

    def wait(self, timeout: float | None = None) -> RunResult | None:
        """Wait until every task finished this call (None) or the run ended (its result: a
        task failed; the entry is dropped). TimeoutError after ``timeout`` s (the call goes
        on)."""
        entry = self._entry
        deadline = None if timeout is None else time.monotonic() + timeout
        with entry.changed:
            while not entry.done.get(self.number, set()) >= set(entry.tasks):
                if not entry.run.alive:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"call {self.number} of run {entry.run.run_id} still runs")
                entry.changed.wait(_CHECK_S)
            else:
                entry.busy = False
                return None
        _drop(entry)
        return entry.run.wait()


def take(
    key: str,
    tasks: tuple[str, ...],
    payload: bytes,
    console: api.ConsoleTarget,
    start: Callable[[], api.Run],
) -> Lease | None:
    """A lease on the entry of ``key`` for a call of ``payload``: the live entry's next call,
    or call 0 of a new entry (``start`` launches its run, the payload among its files). None
    when the entry serves another call now (the caller then runs one-shot)."""
    global _entry
    with _lock:
        entry = _entry
        if entry is not None and entry.run.alive and entry.busy:
            return None
        if entry is not None and (entry.key != key or not entry.run.alive):
            _entry = None
            _stop(entry)  # another shape: its interpreters would only hold memory
        if _entry is None:
            _entry = _Entry(key, start(), tasks)
            return Lease(_entry, 0)
        entry = _entry
        entry.busy = True
        number, entry.calls = entry.calls, entry.calls + 1
    _write(payload_path(entry.run.run_dir, number), payload)
    entry.run.console = console
    for task in tasks:
        _wake(wake_path(entry.run.run_dir, task), number)
    return Lease(entry, number)


@atexit.register  # before launcher/api/launch.py's stop of every run (atexit runs last first)
def close() -> None:
    """Stop the pool's entry, if any: its tasks end, nothing of it is left, and the next call
    starts a cluster anew (`distlaunch.close_pool`; also at the caller's exit)."""
    global _entry
    with _lock:
        entry, _entry = _entry, None
    if entry is not None:
        _stop(entry)


def _stop(entry: _Entry) -> None:
    """End an entry's run without a word. An idle entry's tasks are told to return, so the run
    ends as a one-shot call's does; a TensorFlow task would swallow the SIGTERM of a stop and be
    killed only after the spec's grace, and every caller's exit would wait for that. A busy
    entry, or one whose tasks do not end by _CLOSE_S, is stopped (TERM, grace, KILL)."""
    entry.run.console = None
    if entry.run.alive and not entry.busy:
        for task in entry.tasks:
            _wake(wake_path(entry.run.run_dir, task), CLOSE)
        try:
            entry.run.wait(_CLOSE_S)
        except TimeoutError:
            pass
    entry.run.stop()  # returns the result of a run that has ended


def _drop(entry: _Entry) -> None:
    global _entry
    with _lock:
        if _entry is entry:
            _entry = None


def _write(path: Path, data: bytes) -> None:
    """Write ``data`` atomically: a task never reads half a payload."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _wake(fifo: Path, number: int | str) -> None:
    """Tell a serving task the number of its next call (or CLOSE). A task that is gone has no
    reader on its FIFO: nothing to do, its run is ending and the wait sees that."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return
    try:
        os.write(fd, f"{number}\n".encode())
    finally:
        os.close(fd)
