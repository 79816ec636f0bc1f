"""The run's tasks as the loop holds them, and what is done to their processes.

Each `Task` is one planned task: its plan, its ledger, and its current incarnation (the
transport's handle, the log follower that echoes it, how it ended). The `Crew` starts, kills and
stops incarnations through the transport (the `transports.base` interface, nothing else), watches
their exit fds in the loop's one selector, echoes their logs, finds each one's program below its
keeper, and reads where each is (stacks). It decides nothing: the supervisor says what to do, the
`Journal` records it.
"""

from __future__ import annotations

import os
import selectors
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from distlaunch.launcher.core.console import Console, LogFollower
from distlaunch.launcher.plan.plan import Plan, TaskPlan
from distlaunch.launcher.record.endings import EventKind
from distlaunch.launcher.record.state import RunBook, TaskState
from distlaunch.launcher.run.journal import Journal
from distlaunch.launcher.run.task import Task
from distlaunch.launcher.transports.base import TaskHandle, Transport

if TYPE_CHECKING:
    from distlaunch.launcher.diagnosis import stacks


class Crew:
    """Every task of the run, and their processes through the transport."""

    def __init__(
        self, plan: Plan, book: RunBook, console: Console, transport: Transport, journal: Journal
    ) -> None:
        self.run_dir = Path(plan.run_dir)
        self.book = book
        self.console = console
        self.transport = transport
        self.journal = journal
        self.tasks = {
            t.name: Task(t, i, book.ledger(t.name, t.role, t.index, t.port))
            for i, t in enumerate(plan.tasks)
        }
        self.retired: dict[str, Task] = {}  # tasks of an elastic run's earlier, bigger world
        self._width = max(len(t.name) for t in plan.tasks)
        self._programs: dict[str, int] = {}  # task -> its program's pid (see `program`)
        self._sel = selectors.DefaultSelector()
        self._keys: dict[str, selectors.SelectorKey] = {}  # the latest `ready`'s, by task
        self.stacks_dir = ""  # the folder of the latest stacks capture

    def __getitem__(self, name: str) -> Task:
        return self.tasks[name]

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks.values())

    def alive(self) -> list[Task]:
        """The tasks whose current incarnation runs."""
        return [t for t in self.tasks.values() if t.alive]

    def exited(self) -> dict[str, int]:
        """Each task that has ended in the current attempt, and how."""
        return {n: t.exit_code for n, t in self.tasks.items() if t.exit_code is not None}

    def adopt(self, plan: Plan) -> None:
        """An elastic run's new world (its tasks all ended): its tasks are the crew, each name
        keeping its ledger (``worker-1`` is the new world's second worker, wherever its slot is);
        the names it no longer has are retired (their entries stay in run.json)."""
        tasks = {}
        for plan_task in plan.tasks:
            name = plan_task.name
            task = self.tasks.pop(name, None) or self.retired.pop(name, None)
            if task is None:
                ledger = self.book.ledger(name, plan_task.role, plan_task.index, plan_task.port)
                task = Task(plan_task, len(self.tasks) + len(self.retired) + len(tasks), ledger)
            task.plan = plan_task
            task.ledger.entry.port = plan_task.port
            tasks[name] = task
        self.retired.update(self.tasks)
        self.tasks = tasks
        self._width = max(len(t.name) for t in plan.tasks)

    # ---- the loop's waiting -----------------------------------------------------------------

    def watch_wakeup(self, fd: int) -> None:
        """Wake the loop's `ready` when ``fd`` (the signal handlers' self-pipe) is readable."""
        self._sel.register(fd, selectors.EVENT_READ, None)

    def pump(self) -> bool:
        """Echo what the tasks' logs have new; whether any has more waiting."""
        more = False
        for task in self.tasks.values():
            if task.follower is not None:
                more |= task.follower.pump()
        self.console.out.flush()
        return more

    def ready(self, timeout: float, order: Callable[[Task], object]) -> list[Task]:
        """Wait up to ``timeout`` for exits (or a wake-up); the tasks that exited, by ``order``."""
        self._keys.clear()
        for key, _ in self._sel.select(timeout):
            if key.data is None:
                _drain(key.fd)
            else:
                self._keys[key.data.name] = key
        return sorted((k.data for k in self._keys.values()), key=order)

    def claim(self, task: Task) -> bool:
        """Stop watching ``task``'s exit seen by `ready`; False when an earlier exit of the same
        batch already dealt with it (a gang restart killed it: its exit is recorded)."""
        key = self._keys[task.name]
        if self._sel.get_map().get(key.fd) is not key:
            return False
        self._sel.unregister(key.fd)
        return True

    # ---- starting and ending ----------------------------------------------------------------

    def start(self, plan: TaskPlan, restarts: int) -> Task:
        """Start ``plan``'s task (a new incarnation) and watch its exit."""
        task = self.tasks[plan.name]
        if task.follower is not None:
            task.follower.close()
        if task.handle is not None:
            # The previous incarnation is stopped and reaped: release its pidfd (and an SSH
            # client's stdin pipe) before its successor takes its place.
            task.handle.close()
        handle = self.transport.start(plan)
        task.plan, task.handle, task.exit_code, task.ending = plan, handle, None, EventKind.EXITED
        self._programs.pop(plan.name, None)
        task.started = time.monotonic()
        prefix = self.console.prefix(plan.name, task.number, self._width)
        task.follower = LogFollower(plan.log_file, prefix, self.console)
        self._sel.register(handle.exit_fd, selectors.EVENT_READ, task)
        self.journal.started(task, handle, restarts)
        return task

    def reap(self, task: Task) -> int:
        """The exit code of a task that has ended (its exit fd was readable, or its transport
        stopped it); closes its log."""
        assert task.handle is not None and task.follower is not None
        code = task.handle.exit_status()
        assert code is not None, f"{task.name}: no exit status after its end"
        task.exit_code = code
        task.follower.close()
        return code

    def kill(self, tasks: list[Task]) -> None:
        """Kill tasks now (for restarts: nothing of theirs is worth a grace)."""
        self.transport.kill(self._unwatch(tasks))
        with self.journal.batch():
            for task in tasks:
                self.journal.ended(task, TaskState.KILLED, "killed", self.reap(task), "restarting")

    def stop(self, tasks: list[Task], state: TaskState, reason: str, grace_s: float) -> None:
        """Stop tasks the polite way: SIGTERM, the grace period, SIGKILL."""
        self.transport.stop(self._unwatch(tasks), grace_s)
        with self.journal.batch():
            for task in tasks:
                self.journal.ended(task, state, state.value, self.reap(task), reason)

    def _unwatch(self, tasks: list[Task]) -> list[TaskHandle]:
        handles = []
        for task in tasks:
            assert task.handle is not None
            handles.append(task.handle)
            try:
                self._sel.unregister(task.handle.exit_fd)
            except (KeyError, ValueError):
                pass
        return handles

    def close(self) -> None:
        """Release every task's log, handle and the selector (the tasks have ended)."""
        for task in [*self.tasks.values(), *self.retired.values()]:
            if task.follower is not None:
                task.follower.close()
            if task.handle is not None:
                task.handle.close()
        self._sel.close()

    # ---- where the tasks are ------------------------------------------------------------------

    def program(self, task: Task) -> int:
        """The pid of the task's program (below taskinit's keeper), found once it exists."""
        assert task.handle is not None
        keeper = task.handle.pid
        found = self._programs.get(task.name)
        if found is None or found == keeper:
            from distlaunch.launcher.diagnosis import stacks

            found = self._programs[task.name] = stacks.program_pid(keeper)
        return found

    def capture_stacks(self) -> list[stacks.Capture]:
        """Every running task's stacks, into RUN/stacks/<time>/ (Python frames: fast), each read
        where the task runs, as its transport says."""
        from distlaunch.launcher.diagnosis import stacks

        sources = {
            t.name: self.transport.stacks(t.handle, native=False)
            for t in self.tasks.values()
            if t.alive and t.handle is not None
        }
        if not sources:
            return []
        self.console.say(f"capturing the stacks of {', '.join(sources)}")
        try:
            captures = stacks.capture(self.run_dir, sources)
        except (OSError, stacks.StackError) as exc:
            self.console.say(f"could not capture stacks: {exc}")
            return []
        self.stacks_dir = str(captures[0].file.parent) if captures else ""
        return captures

    def stacks_where(self, silent: bool = False) -> tuple[str, ...]:
        """Every running task's stacks captured (`capture_stacks`), one line each."""
        from distlaunch.launcher.diagnosis import stacks

        return tuple(stacks.summary(self.capture_stacks(), silent=silent))


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass
