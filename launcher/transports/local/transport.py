"""The local transport: tasks as child processes of the launcher on this machine."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from distlaunch.launcher.network.netns import Sandbox, SandboxLost
from distlaunch.launcher.plan.plan import TaskPlan
from distlaunch.launcher.record import rundir
from distlaunch.launcher.transports import procs, taskinit
from distlaunch.launcher.transports.local.standby import Standbys
from distlaunch.worker import contract

if TYPE_CHECKING:
    from distlaunch.launcher.diagnosis import stacks
    from distlaunch.launcher.record.state import TaskRecord


def task_stacks(keeper: int, signal_file: Path, native: bool) -> stacks.Source:
    """Where a local task's stacks are read: py-spy on its program, the process below taskinit's
    keeper ``keeper`` (the pid the launcher started); where py-spy cannot read it, the program's
    faulthandler dump into ``signal_file``. The keeper (which would pass a signal on to the
    program's whole group) is never read or signalled."""

    def source() -> str:
        # Imported when a task's stacks are read, not on the way to a run's first task.
        from distlaunch.launcher.diagnosis import stacks

        program = stacks.program_pid(keeper)
        if program == keeper:
            raise stacks.StackError("its program has not started yet")
        return stacks.local(program, native, signal_file)()

    return source


def recorded_task_stacks(run_dir: Path, entry: TaskRecord, native: bool) -> stacks.Source:
    """`task_stacks` of a local task as run.json records it (`distlaunch stacks`)."""
    assert entry.pid is not None
    signal = contract.stacks_signal_path(run_dir, entry.attempt, entry.role, entry.index)
    return task_stacks(entry.pid, signal, native)


def signal_file(task: TaskPlan) -> Path:
    """The file the task's faulthandler writes its stacks to (where its bootstrap reads it from)."""
    return contract.stacks_signal_path(
        Path(task.env[contract.RUN_DIR]), task.attempt, task.role, task.index
    )


class LocalHandle(procs.TaskProcess):
    """One running local task: the task's own process."""

    def __init__(
        self,
        task: TaskPlan,
        proc: subprocess.Popen,
        tree_fd: int,
        sandbox: Sandbox | None,
        ports: ListeningPorts,
        warm: bool = False,
    ) -> None:
        super().__init__(task, proc, tree_fd)
        self.warm = warm
        # Any process in the task's network namespace shows its sockets; the sandbox's holder is
        # in it from the start, while the task itself is only once taskinit has entered it.
        self.sandbox = sandbox
        self._ports = ports

    def joined(self) -> bool:
        """Whether the task's TensorFlow server listens on its port."""
        if self.sandbox is None:
            # Without a sandbox the task shares the launcher's network namespace.
            return self.task.port in self._ports.of(os.getpid())
        if not self.sandbox.alive():  # its pid may be another process's by now
            raise SandboxLost(self.sandbox.dead_message())
        return self.task.port in self._ports.of(self.sandbox.pid)


class ListeningPorts:
    """The listening ports of a network namespace, read once for all the tasks in it, and only
    when they may have changed.

    The supervisor asks each starting task in turn whether it has joined; they all share one
    namespace, whose socket table lists every one of their servers, so a table read less than
    MAX_AGE_S ago (below the supervisor's check interval) answers for all of them. Reading the
    table costs tens of milliseconds however empty the namespace is (the kernel walks every
    namespace's sockets), and a task that never listens (an evaluator, a plain script) is asked
    for its whole life: the table is read again only when the namespace's count of TCP sockets
    in use has changed (a new server counts), or MAX_STALE_S after the last read, in case a
    server came up while another socket closed.
    """

    MAX_AGE_S = 0.1
    MAX_STALE_S = 2.0

    def __init__(self) -> None:
        # pid -> (when read, the TCP sockets in use then, the listening ports)
        self._tables: dict[int, tuple[float, tuple[int, int] | None, set[int]]] = {}

    def of(self, pid: int) -> set[int]:
        """The ports listening in the network namespace of process ``pid``."""
        now = time.monotonic()
        read = self._tables.get(pid)
        if read is not None and now - read[0] <= self.MAX_AGE_S:
            return read[2]
        in_use = procs.tcp_sockets_in_use(pid)
        if read is None or in_use is None or in_use != read[1] or now - read[0] > self.MAX_STALE_S:
            read = self._tables[pid] = (now, in_use, procs.listening_ports(pid))
        return read[2]


class LocalTransport:
    """Starts and stops tasks as local process groups, inside ``sandbox`` when the run has one.

    Each task runs in a PID namespace of its own (procs.spawn_contained): whatever it forked dies
    with it, and a task is started again only once all of its predecessor is gone, so no child of
    the last attempt can hold its port.

    With ``standby`` a restarted task starts from its warm standby where one was made for it
    (launcher/transports/local/standby.py; the supervisor decides when ``standbys`` makes them).
    """

    def __init__(self, sandbox: Sandbox | None = None, standby: bool = False) -> None:
        self.sandbox = sandbox
        self._last: dict[str, LocalHandle] = {}
        self.standbys = Standbys(sandbox) if standby else None
        self._ports = ListeningPorts()

    def start(self, task: TaskPlan) -> LocalHandle:
        """Start one task; its output goes to its log file."""
        if self.sandbox is not None and not self.sandbox.alive():
            raise SandboxLost(self.sandbox.dead_message())
        previous = self._last.get(task.name)
        if previous is not None:
            # Waits until the last attempt's processes are all gone, then frees its descriptors
            # (a run with 200 restarts must not hold 400 of them).
            previous.close()
        warm = self.standbys.take(task) if self.standbys is not None else None
        if warm is not None:
            proc, tree_fd = warm
        else:
            # Created here so that its mode follows the run dir's (the spec's `permissions`).
            rundir.create_file(task.log_file)
            namespaces = self.sandbox.namespaces() if self.sandbox is not None else None
            proc, tree_fd = procs.spawn_contained(
                task.argv, task.env, task.cwd, task.log_file, namespaces, cpus=task.cpus.ids
            )
        handle = LocalHandle(task, proc, tree_fd, self.sandbox, self._ports, warm=warm is not None)
        self._last[task.name] = handle
        return handle

    def stop(self, handles: Sequence[LocalHandle], grace_s: float) -> None:
        """Stop the tasks: SIGTERM, ``grace_s``, SIGKILL; return once nothing of theirs is left."""
        procs.stop_groups([h.proc for h in handles], grace_s)
        for handle in handles:
            handle.wait_tree()

    def notify(self, handles: Sequence[LocalHandle]) -> bool:
        """Send each task a stop notice: SIGTERM to its program alone (taskinit's NOTICE to its
        keeper, alone in its group, which has the init pass it to the program's pid only)."""
        for handle in handles:
            procs.signal_group(handle.pid, taskinit.NOTICE)
        return True

    def kill(self, handles: Sequence[LocalHandle]) -> None:
        """SIGKILL the tasks now and reap them; return once nothing of theirs is left."""
        procs.kill_groups(h.proc for h in handles)
        for handle in handles:
            handle.wait_tree()

    def stacks(self, handle: LocalHandle, native: bool) -> stacks.Source:
        """The task's program, read here (see `task_stacks`)."""
        return task_stacks(handle.pid, signal_file(handle.task), native)
