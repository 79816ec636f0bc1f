"""The run's clocks: when a task joined, and which deadline has passed.

Checked periodically by the loop while the run trains: each starting task's join or its startup
deadline (timeouts.startup_s), each training task's heartbeat (heartbeat_s) and progress (log
output, heartbeat or CPU: silence_s, through `diagnosis.watchdog`), the cluster's formation once
settled (formation_s) and the run's time limit (run_s); once training is done, the evaluator's
drain (evaluator_drain_s). A passed deadline is returned as a `Lapse` (the task, the event kind,
the words, and where every task was when it passed); what it means is the policy's. A stop
notice's save deadline is `notice.StopNotices`'s, the grace of a stop the transport's.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from distlaunch.launcher.diagnosis.watchdog import Sample, Watchdog
from distlaunch.launcher.record import rundir
from distlaunch.launcher.record.endings import EventKind
from distlaunch.launcher.record.state import TaskState
from distlaunch.launcher.run.crew import Crew
from distlaunch.launcher.run.journal import Journal
from distlaunch.launcher.run.task import Task
from distlaunch.launcher.spec.model import Timeouts
from distlaunch.worker import contract


@dataclass(frozen=True)
class Lapse:
    """A deadline that passed: ``kind`` of ``task`` (HUNG: it stopped making progress, for
    ``silent_s``), in ``how``'s words, with ``where`` the tasks were (their stacks) then."""

    task: Task
    kind: EventKind
    how: str
    where: tuple[str, ...] = ()
    silent_s: float = 0.0


class Deadlines:
    """The deadlines of a run's tasks and of the run, checked against the time."""

    def __init__(self, crew: Crew, journal: Journal, timeouts: Timeouts) -> None:
        self.crew = crew
        self.journal = journal
        self.timeouts = timeouts
        self.watchdog = Watchdog()
        self.run_started = 0.0  # time.monotonic() of the run's start
        self.settled_since = 0.0  # time.monotonic() of the latest task start or join
        self._formation_seen = -1.0  # the settled_since whose cluster formation was checked
        self.drain_until: float | None = None  # training is done; the evaluator's drain ends

    def started(self, task: Task) -> None:
        """A new incarnation of ``task`` started: its clocks start again."""
        self.watchdog.reset(task.name)
        self.settled_since = task.started

    def drain(self, now: float) -> None:
        """Training is done: the evaluator has timeouts.evaluator_drain_s to finish."""
        self.drain_until = now + self.timeouts.evaluator_drain_s

    def settled(self, now: float, for_s: float, pending: bool) -> bool:
        """Whether every live training task has been joined for ``for_s``, no restart
        ``pending`` and training not over."""
        return (
            not pending
            and self.drain_until is None
            and now - self.settled_since >= for_s
            and all(t.ledger.state is TaskState.RUNNING for t in self.crew.alive() if t.training)
        )

    def check(self, now: float, waiting: list[str]) -> Lapse | None:
        """While training: each task's join, heartbeat and progress, the cluster's formation
        and the run's time limit (``waiting``: the tasks waiting out a restart's backoff)."""
        wall = time.time()
        for task in self.crew.alive():
            if task.training:
                lapse = self._check_task(task, now, wall)
                if lapse is not None:
                    return lapse
        return self._check_formation(now, bool(waiting)) or self._check_run_time(now, waiting)

    def drain_due(self, now: float) -> bool:
        """Whether training is done and the evaluator's drain time is out."""
        return self.drain_until is not None and now >= self.drain_until

    def drained(self) -> Lapse | None:
        """The drain's end (`drain_due`) as the evaluator's DRAINED, or whatever still runs;
        None when nothing runs any more (nothing to drain)."""
        drain = self.timeouts.evaluator_drain_s
        why = f"the evaluator did not finish within {drain:g} s (timeouts.evaluator_drain_s)"
        alive = self.crew.alive()
        evaluator = next((t for t in alive if not t.training), alive[0] if alive else None)
        return Lapse(evaluator, EventKind.DRAINED, why) if evaluator is not None else None

    def _check_task(self, task: Task, now: float, wall: float) -> Lapse | None:
        """A live training task: has it joined, missed its startup deadline, stopped beating or
        gone silent?"""
        assert task.handle is not None
        timeouts = self.timeouts
        if task.ledger.state is TaskState.STARTING:
            if task.handle.joined():
                self.settled_since = now
                self.journal.joined(task, now - task.started)
            elif timeouts.startup_s is not None and now - task.started > timeouts.startup_s:
                how = (
                    f"did not start its TensorFlow server on port {task.plan.port} "
                    f"within {timeouts.startup_s:g} s (timeouts.startup_s)"
                )
                return Lapse(task, EventKind.STARTUP_TIMEOUT, how, self.crew.stacks_where())
        if timeouts.heartbeat_s is not None:
            silent = self._silent_for(task, wall)
            if silent is not None and silent > timeouts.heartbeat_s:
                where = self.crew.stacks_where(silent=True)
                return Lapse(
                    task, EventKind.HUNG, f"no heartbeat for {silent:.0f} s", where, silent
                )
        silent = self.watchdog.observe(task.name, now, self._sample(task))
        if timeouts.silence_s is not None and silent > timeouts.silence_s:
            return self._silence(task, silent, now)
        return None

    def _silence(self, task: Task, silent_s: float, now: float) -> Lapse:
        """No task output, heartbeat or CPU for silence_s: capture where every task is, then
        name the silent task stuck in its own code (the others wait in TensorFlow for it)."""
        from distlaunch.launcher.diagnosis import stacks

        captures = self.crew.capture_stacks()
        # Who may be named hung: the tasks silent for most of the window too (the hung one went
        # quiet around when its peers blocked on it); a task that printed or beat since works.
        half = (self.timeouts.silence_s or 0) / 2
        silent = {task.name} | {
            t.name for t in self.crew.alive() if self.watchdog.silent_for(t.name, now) > half
        }
        stuck = stacks.hung(captures, silent)
        culprit = self.crew[stuck[0].task] if stuck else task
        how = (
            f"hung: no log output, heartbeat or CPU progress for {silent_s:.0f} s "
            "(timeouts.silence_s)"
        )
        where = tuple(stacks.summary(captures, silent=True, among=silent))
        return Lapse(culprit, EventKind.HUNG, how, where, silent_s)

    def _check_formation(self, now: float, pending: bool) -> Lapse | None:
        """Once every training task has had its server up for timeouts.formation_s, ask the
        coordination service's log whether they all connected (once per settling: a restart's
        rejoin asks again). A task still missing cannot reach the leader's port."""
        formation_s = self.timeouts.formation_s
        if self._formation_seen == self.settled_since or not self.settled(
            now, formation_s, pending
        ):
            return None
        from distlaunch.launcher.diagnosis import formation

        self._formation_seen = self.settled_since
        name = formation.leader(list(self.crew.tasks))
        if name is None:
            return None
        leader = self.crew[name]
        seen = formation.latest(leader.plan.log_file)
        if seen is None or seen.missing == 0:
            return None
        missing = [s for s in seen.stragglers if s in self.crew.tasks] or [name]
        how = (
            f"never connected to the coordination service on {leader.name} "
            f"({leader.plan.address}), {seen.missing} of {seen.total} tasks "
            f"missing {formation_s:g} s after every task started its server "
            "(timeouts.formation_s): the tasks cannot reach each other's ports (a firewall "
            "between hosts, a container network that drops traffic, a host name that resolves "
            "elsewhere)"
        )
        return Lapse(self.crew[missing[0]], EventKind.FORMATION, how, self.crew.stacks_where())

    def _check_run_time(self, now: float, waiting: list[str]) -> Lapse | None:
        """The run's time limit (timeouts.run_s), for the task still running or, when every task
        is down waiting out a backoff, the one waiting to restart."""
        run_s = self.timeouts.run_s
        if run_s is None or now - self.run_started <= run_s:
            return None
        limit = f"the run hit its time limit of {run_s:g} s (timeouts.run_s)"
        running = self.crew.alive()
        if running:
            how = f"was still running when {limit}"
            return Lapse(running[0], EventKind.RUN_TIMEOUT, how, self.crew.stacks_where())
        how = f"was waiting to restart when {limit}"
        return Lapse(self.crew[waiting[0]], EventKind.RUN_TIMEOUT, how)

    def _sample(self, task: Task) -> Sample:
        """What the watchdog needs of a task: log size, heartbeat, CPU time and RSS."""
        plan = task.plan
        try:
            log_bytes = os.stat(plan.log_file).st_size
        except OSError:
            log_bytes = 0
        status = rundir.read_json(contract.status_path(self.crew.run_dir, plan.role, plan.index))
        beat = status.get("time") if isinstance(status, dict) else None
        cpu, rss = _cpu_and_rss(self.crew.program(task))
        return Sample(log_bytes, beat if isinstance(beat, (int, float)) else None, cpu, rss)

    def _silent_for(self, task: Task, wall: float) -> float | None:
        """Seconds since this incarnation's last heartbeat; None before its first one."""
        beat = task.status(self.crew.run_dir).get("time")
        return wall - beat if isinstance(beat, (int, float)) else None


_TICK_S = 1 / os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _cpu_and_rss(pid: int) -> tuple[float | None, int | None]:
    """A process's CPU seconds (its own and its reaped children's) and RSS bytes, from one read
    of /proc/PID/stat (psutil takes three reads: it is asked for every task at every check)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The fields after the command name (which may hold spaces), from field 3 (state).
            fields = f.read().rsplit(b")", 1)[1].split()
        # Fields 14-17: utime, stime, cutime, cstime; field 24: rss in pages.
        ticks = sum(int(fields[i]) for i in range(11, 15))
        return ticks * _TICK_S, int(fields[21]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None, None
