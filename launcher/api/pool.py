"""The warm pool of `distlaunch.run`: later calls in one Python process reuse the tasks (and the
TensorFlow import) of an earlier call of the same shape.

An entry of the pool is a live run, started by `launch` as any call's run is (the same spec
validation, isolation and supervision), whose tasks serve call after call (worker/call.py
--serve; under ParameterServerStrategy the chief, the ps and worker tasks serving on). Call N
moves its payload into the run dir and writes N into each task's wake FIFO. Each task tells the
caller on a channel of its own, never in its output (the user's function writes there, with or
without newlines, from threads that go on printing): its done FIFO carries ``N`` once call N's
result is written, and EOF once the task has ended, however it ended. A call that fails ends its
task, so the run fails as a one-shot run does; the caller gets the same error from the run's
result and the entry is dropped. A task that ends cleanly in the middle of a call
(``sys.exit(0)``, ``os._exit(0)``) leaves its peers waiting for the next call: the caller stops
the run and raises a TaskError naming the task ("worker-0 exited with status 0 before
returning").

Between calls nothing of the run reaches the caller: once a call has ended (and its last lines
had a moment to arrive) the run's output goes to its run dir only, until the next call.

One entry at most: a call of another shape (counts, strategy, env, working directory) stops it
and starts its own; a call made while the entry serves another call (from another thread) runs
one-shot. The entry is a `Run`, so it lives no longer than this process: stopped at exit, and on
a SIGKILL its launcher, which watches this process, stops every task. A process forked from this
one (multiprocessing's default on Linux) starts with no entry: the parent's is the parent's.
"""

from __future__ import annotations

import atexit
import os
import select
import threading
import time
from collections.abc import Callable
from pathlib import Path

from distlaunch.launcher.api import launch as api
from distlaunch.launcher.api.results import RunResult, TaskError
from distlaunch.worker.call import CLOSE, OPEN, done_path, payload_path, wake_path

# The off switch: DISTLAUNCH_POOL=0 makes every call one-shot (the `pool=` argument wins).
POOL_ENV = "DISTLAUNCH_POOL"
_OFF = ("0", "false", "no", "off")
# How often a waiting call looks whether its run has ended: the tasks' done FIFOs wake it as
# soon as they speak.
_CHECK_S = 0.2
# After the last task finished a call, its last lines are still on their way through the
# launcher (which reads the tasks' logs every 0.05 s): the call's console stays attached until
# the run's output has been quiet for _SETTLE_QUIET_S (at least _SETTLE_MIN_S, at most
# _SETTLE_MAX_S: a thread that keeps printing does not hold the call).
_SETTLE_MIN_S = 0.08
_SETTLE_QUIET_S = 0.08
_SETTLE_MAX_S = 0.3
# How long a task that ended mid-call may take to show its exit status in run.json.
_EXIT_RECORD_S = 10.0


def enabled(pool: bool | None) -> bool:
    """Whether a call uses the pool: ``pool`` if given, else DISTLAUNCH_POOL (on unless 0)."""
    if pool is not None:
        return pool
    return os.environ.get(POOL_ENV, "1").strip().lower() not in _OFF


class _Channel:
    """This side of a serving task's done FIFO: the calls it finished, and whether it ended."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None
        self.opened = False  # the task's OPEN was read: EOF from now on means it ended
        self.gone = False
        self.finished = -1  # the latest call the task finished
        self._partial = b""

    def open(self) -> None:
        """Open the FIFO once the task has made it (it does, before call 0)."""
        if self.fd is None and not self.gone:
            try:
                self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            except FileNotFoundError:
                pass

    def read(self) -> None:
        """Take what the task wrote; note its end."""
        if self.fd is None:
            return
        try:
            data = os.read(self.fd, 4096)
        except BlockingIOError:
            return
        if data:
            lines = (self._partial + data).split(b"\n")
            self._partial = lines.pop()
            for line in lines:
                word = line.decode().strip()
                if word == OPEN:
                    self.opened = True
                elif word.isdigit():
                    self.finished = max(self.finished, int(word))
            return
        os.close(self.fd)
        self.fd = None
        # EOF before OPEN: the task has not opened its end yet (it makes the FIFO and opens it
        # at once); this side opens again on the next look.
        self.gone = self.opened

    def close(self) -> None:
        """Close this side (the entry is dropped)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class _Entry:
    """A live run whose tasks serve calls, and what each task has told about its calls."""

    def __init__(self, key: str, run: api.Run, tasks: tuple[str, ...]) -> None:
        self.key, self.run, self.tasks = key, run, tasks
        self.calls = 1  # call 0 is the run's own payload
        self.busy = True
        self.channels = {task: _Channel(done_path(run.run_dir, task)) for task in tasks}

    def look(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for any task to tell something; read what they told."""
        poller = select.poll()
        for channel in self.channels.values():
            channel.open()
            if channel.fd is not None:
                poller.register(channel.fd, select.POLLIN | select.POLLHUP)
        poller.poll(max(0, int(timeout * 1000)))
        for channel in self.channels.values():
            channel.read()

    def ended_unheard(self, task: str) -> bool:
        """Whether ``task`` ended before this side heard its ``open``: a task that writes it and
        exits before the caller opened the FIFO takes the word with it (a FIFO's data goes with
        its last open end), so its EOF would read as "not open yet" for ever; its exit, which
        the launcher records, says it."""
        if self.channels[task].opened:
            return False
        return api.reads().exit_code_of(self.run.run_dir, task) is not None

    def close(self) -> None:
        """Close this side of every task's channel."""
        for channel in self.channels.values():
            channel.close()


_lock = threading.Lock()
_entry: _Entry | None = None
# How long a closing entry's tasks may take to return before their run is stopped.
_CLOSE_S = 30.0
# Entries inherited from the parent in a forked process: never used, never closed here (their
# pipes and files are the parent's too).
_inherited: list[_Entry] = []


class Lease:
    """One call on the pool's entry: its number, and the wait for its end."""

    def __init__(self, entry: _Entry, number: int) -> None:
        self._entry = entry
        self.number = number
        self.run = entry.run

    def wait(self, timeout: float | None = None) -> RunResult | None:
        """Wait until every task finished this call (None) or the run ended (its result: a
        task failed; the entry is dropped). TaskError when a task ended cleanly before it
        returned (the run is stopped). TimeoutError after ``timeout`` s (the call goes on)."""
        entry = self._entry
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            pending = [t for t in entry.tasks if entry.channels[t].finished < self.number]
            if not pending:
                _settle(entry.run)
                entry.busy = False
                return None
            gone = [t for t in pending if entry.channels[t].gone or entry.ended_unheard(t)]
            if gone or not entry.run.alive:
                break
            left = _CHECK_S if deadline is None else min(_CHECK_S, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"call {self.number} of run {entry.run.run_id} still runs")
            entry.look(left)
        _drop(entry)
        if gone:
            _ended_mid_call(entry.run, gone[0])
        return entry.run.wait()


def _ended_mid_call(run: api.Run, task: str) -> None:
    """``task`` ended before it finished its call. An exit that fails the run ends it: the caller
    then reads the failure from its result. A clean exit does not (its peers wait for the next
    call): the run is stopped and TaskError raised."""
    deadline = time.monotonic() + _EXIT_RECORD_S
    code = None
    while run.alive and code is None and time.monotonic() < deadline:
        code = api.reads().exit_code_of(run.run_dir, task)
        if code is None:
            time.sleep(0.05)
    if not run.alive or (code is not None and code != 0):
        return
    run.console = None  # the stop's own report is no news: the TaskError says it
    run.stop(save=False)
    status = "status 0" if code == 0 else "no recorded status"
    raise TaskError(
        f"{task} exited with {status} before returning (run {run.run_id}, run dir {run.run_dir})",
        task=task,
        run_dir=str(run.run_dir),
    )


def _settle(run: api.Run) -> None:
    """Let the call's last lines reach its console, then detach it (see the module docstring)."""
    if run.console is None:
        return  # a quiet call: its lines go to the run dir only, there is nothing to wait for
    start = time.monotonic()
    while True:
        now = time.monotonic()
        quiet = now - max(run.last_output, start) >= _SETTLE_QUIET_S
        if now - start >= _SETTLE_MAX_S or (now - start >= _SETTLE_MIN_S and quiet):
            break
        time.sleep(0.02)
    run.console = None


def take(
    key: str,
    tasks: tuple[str, ...],
    payload: Path,
    console: api.ConsoleTarget,
    start: Callable[[], api.Run],
) -> Lease | None:
    """A lease on the entry of ``key`` for a call of the payload file ``payload`` (moved into
    the run dir): the live entry's next call, or call 0 of a new entry (``start`` launches its
    run, the payload among its files). None when the entry serves another call now (the caller
    then runs one-shot)."""
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
    target = payload_path(entry.run.run_dir, number)
    _move(payload, target)
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


def forget(run: api.Run) -> None:
    """Drop the entry of ``run`` (stopped by an interrupted call) without a word."""
    global _entry
    with _lock:
        if _entry is not None and _entry.run is run:
            _entry.close()
            _entry = None


def _stop(entry: _Entry) -> None:
    """End an entry's run without a word. An idle entry's tasks are told to return, so the run
    ends as a one-shot call's does; a TensorFlow task would swallow the SIGTERM of a stop and be
    killed only after the spec's grace, and every caller's exit would wait for that. A busy
    entry, or one whose tasks do not end by _CLOSE_S, is stopped (TERM, grace, KILL)."""
    entry.run.console = None
    entry.close()
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
    entry.close()
    with _lock:
        if _entry is entry:
            _entry = None


def _move(source: Path, target: Path) -> None:
    """Move the payload file into the run dir atomically: a task never reads half a payload."""
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        os.replace(source, tmp)
    except OSError:  # another file system: copied, without holding it in memory
        import shutil

        shutil.move(source, tmp)
    os.replace(tmp, target)


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


def _after_fork_in_child() -> None:
    """A forked process starts with no entry and a lock of its own: the parent's entry (its
    launcher, pipes, the echo thread's locks) stays the parent's, and nothing here stops it."""
    global _entry, _lock
    _lock = threading.Lock()
    if _entry is not None:
        _inherited.append(_entry)
        _entry = None


os.register_at_fork(after_in_child=_after_fork_in_child)
