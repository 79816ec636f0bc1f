"""The local transport: tasks as child processes of the launcher on this machine."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from distlaunch.launcher import procs, rundir
from distlaunch.launcher.plan import TaskPlan
from distlaunch.launcher.transports.netns import Sandbox


class LocalHandle(procs.TaskProcess):
    """One running local task: the task's own process."""

    def __init__(self, task: TaskPlan, proc: subprocess.Popen, netns_pid: int | None = None) -> None:
        super().__init__(task, proc)
        # Any process in the task's network namespace shows its sockets; the sandbox's holder is
        # in it from the start, while the task itself is only once nsenter has entered it.
        self.netns_pid = netns_pid

    def joined(self) -> bool:
        """Whether the task's TensorFlow server listens on its port."""
        return procs.listening(self.netns_pid or self.proc.pid, self.task.port)


class LocalTransport:
    """Starts and stops tasks as local process groups, inside ``sandbox`` when the run has one."""

    def __init__(self, sandbox: Sandbox | None = None) -> None:
        self.sandbox = sandbox

    def start(self, task: TaskPlan) -> LocalHandle:
        """Start one task; its output goes to its log file."""
        # Created here so that its mode follows the run dir's (the spec's `permissions`).
        rundir.create_file(task.log_file)
        if self.sandbox is None:
            return LocalHandle(task, procs.spawn(task.argv, task.env, task.cwd, task.log_file))
        argv = (*self.sandbox.prefix(), *task.argv)
        return LocalHandle(task, procs.spawn(argv, task.env, task.cwd, task.log_file), self.sandbox.pid)

    def stop(self, handles: Sequence[LocalHandle], grace_s: float) -> None:
        """Stop the tasks' process groups: SIGTERM, ``grace_s``, SIGKILL."""
        procs.stop_groups([h.proc for h in handles], grace_s)

    def kill(self, handles: Sequence[LocalHandle]) -> None:
        """SIGKILL the tasks' process groups now and reap their leaders."""
        procs.kill_groups(h.proc for h in handles)
