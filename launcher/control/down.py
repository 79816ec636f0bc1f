"""`distlaunch down`: stop whatever is left of a run, also one whose launcher was killed outright.

A launcher that is alive is sent a stop notice (SIGTERM: its tasks save and stop, within the
spec's timeouts.save_s, and the run is recorded as preempted; or, where they cannot, it tears them
down and records the run as interrupted); with ``now`` it is stopped at once (SIGINT, no save).
Users run `down` twice (a retried command, a script and a person, two terminals): a `down` during
the save another one started joins it (the launcher takes the second notice as that same one),
says so, and waits for it like the first; both report how the run ended, as run.json has it.
What a dead launcher leaves behind is found by what every task and everything a
task forks carry in their environment: the run id and the run dir's path (DISTLAUNCH_RUN_ID and
DISTLAUNCH_RUN_DIR), plus the rest of the recorded task process groups those processes are in.
The run id alone is not enough: two projects may both use `--run-id nightly` in their own shared
dirs. Processes that carry only the run id (the namespace holder, an SSH task's local client) are
matched by their recorded pid as well. Never matching on a bare pid means a pid or group id reused
by someone else's process is never signalled.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from distlaunch.launcher.control.liveness import live_launcher
from distlaunch.launcher.record import rundir
from distlaunch.launcher.record.state import RunRecord, RunState, TaskState
from distlaunch.launcher.transports.base import load_backend
from distlaunch.worker import contract

DEFAULT_GRACE_S = 5.0
DEFAULT_SAVE_S = 30.0  # the spec's timeouts.save_s default
# A launcher asked to stop gets its own grace period for its tasks plus this much for itself.
LAUNCHER_SLACK_S = 10.0


@dataclass(frozen=True)
class DownResult:
    """What `down` did to a run."""

    run_id: str
    launcher_pid: int | None  # the live launcher that was asked to stop, if any
    stopped: int  # leftover processes of the run that were stopped
    marked: bool  # whether run.json was changed to interrupted
    cancelled: tuple[str, ...] = ()  # what the backend's cleanup cancelled (job steps, a job)
    backend: str = ""  # the backend as messages name it (`Backend.title`)
    # How the live launcher's run ended, in `down`'s words ("its tasks saved step N; ...",
    # or why nothing was saved); without a live launcher, where a preempted run saved (a
    # second `down` that came as the run ended); else "".
    ended: str = ""


def down(
    run_dir: Path,
    grace_s: float | None = None,
    now: bool = False,
    say: Callable[[str], None] | None = None,
) -> DownResult:
    """Stop the run in ``run_dir``: its launcher if alive, then every leftover process, then
    what its backend left elsewhere (`Backend.cleanup`: job steps on other nodes, containers).

    A live launcher gets a stop notice (its tasks save first) or, with ``now``, SIGINT; when
    a save is under way already, the notice joins it and ``say`` is told which and since when.
    Leftovers get SIGTERM, ``grace_s`` (default: the spec's timeouts.grace_s), then SIGKILL.
    A run recorded as running or stopping is then marked interrupted.
    """
    record = RunRecord.load(run_dir)
    timeouts = record.spec.get("timeouts") or {}
    if grace_s is None:
        grace_s = float(timeouts.get("grace_s", DEFAULT_GRACE_S))
    launcher = live_launcher(record)
    if launcher is not None:
        saving = None if now else _save_under_way(run_dir, record)
        if saving and say is not None:
            say(saving)
        save_s = 0.0 if now else float(timeouts.get("save_s", DEFAULT_SAVE_S))
        sig = signal.SIGINT if now else signal.SIGTERM
        _stop([launcher], save_s + grace_s + LAUNCHER_SLACK_S, sig)
        record = RunRecord.load(run_dir)  # the launcher recorded its own ending
    backend = load_backend(record.backend)
    with backend.cleanup(record, run_dir, grace_s) as cancelled:
        leftovers = _processes_of(record, run_dir)
        _stop(leftovers, grace_s)
    marked = record.state.live
    if marked:
        _mark_interrupted(run_dir, record)
    return DownResult(
        record.run_id,
        launcher.pid if launcher else None,
        len(leftovers),
        marked,
        tuple(cancelled),
        backend.title,
        _ended_words(record, now) if launcher or record.state is RunState.PREEMPTED else "",
    )


def _save_under_way(run_dir: Path, record: RunRecord) -> str | None:
    """The line for a `down` that joins a save under way (run.json's ``notice``, which the
    launcher writes when it sends one); None when no save is under way."""
    notice = record.notice
    if not record.state.live or not isinstance(notice, dict):
        return None
    if "stopped" in notice or "done" in notice or not isinstance(notice.get("at"), (int, float)):
        return None
    steps = []
    for task in record.tasks.values():
        status = rundir.read_json(contract.status_path(run_dir, task.role, task.index))
        if isinstance(status, dict) and status.get("attempt") == record.attempt:
            step = status.get(contract.SAVED_STEP, status.get("step"))
            if isinstance(step, int):
                steps.append(step)
    what = f"step {max(steps)}" if steps else "its tasks"
    since = max(0.0, time.time() - notice["at"])
    return (
        f"run {record.run_id}: saving {what}, started {since:.0f} s ago; waiting for it "
        f"(`distlaunch down --now {record.run_id}` stops without saving)"
    )


def _ended_words(record: RunRecord, now: bool) -> str:
    """How the run of a live launcher ended, in `down`'s words: where it saved, or why not."""
    notice = record.notice if isinstance(record.notice, dict) else {}
    if record.state is RunState.PREEMPTED:
        saved = record.preempted or {}
        if saved.get("step") is None:
            return "its tasks stopped on the notice; `up --resume` continues"
        late = " (after timeouts.save_s, within grace_s)" if saved.get("late") else ""
        return f"its tasks saved step {saved['step']}{late}; `up --resume` continues"
    if record.state is RunState.SUCCEEDED:
        done = notice.get("done")
        return f"it succeeded ({done})" if done else "it had succeeded"
    if record.state is RunState.FAILED:
        why = record.failure.summary if record.failure else "a task failed"
        return f"nothing saved: it failed ({why})"
    if now:
        return "stopped at once (--now): nothing saved"
    stopped = notice.get("stopped")
    if stopped:
        return f"nothing saved: {stopped}"
    return "nothing saved: the program cannot save on a notice"


def _processes_of(record: RunRecord, run_dir: Path) -> list[psutil.Process]:
    """Every live process of the run: those whose environment names it, plus the other members of
    the recorded task process groups they are in (a forked helper may have cleared its env)."""
    recorded = {t.pgid for t in record.tasks.values()}
    named, others, groups = [], [], set()
    for proc in psutil.process_iter():
        try:
            if proc.pid == os.getpid() or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            pgid = os.getpgid(proc.pid)
            if _names_run(proc, record, run_dir):
                named.append(proc)
                if pgid in recorded:
                    groups.add(pgid)
            else:
                others.append((proc, pgid))
        except (psutil.Error, ProcessLookupError):
            continue
    return named + [proc for proc, pgid in others if pgid in groups]


def _names_run(proc: psutil.Process, record: RunRecord, run_dir: Path) -> bool:
    """Whether ``proc``'s environment names this run: its id and its run dir, or its id alone for
    a process the record names by pid (the namespace holder, SSH clients: they carry no run dir)."""
    env = proc.environ()
    if env.get(contract.RUN_ID) != record.run_id:
        return False
    if contract.RUN_DIR in env:
        return os.path.realpath(env[contract.RUN_DIR]) == os.path.realpath(run_dir)
    pids = {t.pid for t in record.tasks.values()}
    pids.add(record.netns_holder_pid)
    return proc.pid in pids


def _stop(procs: list[psutil.Process], grace_s: float, sig: int = signal.SIGTERM) -> None:
    """``sig``, wait up to ``grace_s``, SIGKILL what is left, and wait for it to go."""
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    for proc in _wait_gone(procs, grace_s):
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    _wait_gone(procs, grace_s + 1)


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until every process has ended; return those still running after ``timeout_s``.

    A zombie counts as ended: its parent (not us) reaps it when it will, and it holds nothing.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in procs if _running(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _mark_interrupted(run_dir: Path, record: RunRecord) -> None:
    for task in record.tasks.values():
        if task.state is not None and task.state.live:
            task.state = TaskState.STOPPED
    record.state = RunState.INTERRUPTED
    record.ended_at = record.ended_at or time.time()
    record.stopped_by = "distlaunch down"
    record.save(run_dir)
