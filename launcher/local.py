"""The local transport: tasks as child processes of the launcher on this machine."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence

from distlaunch.launcher import procs
from distlaunch.launcher.plan import TaskPlan


class LocalHandle:
    """One running local task: its process, and a pidfd that becomes readable when it exits."""

    def __init__(self, task: TaskPlan, proc: subprocess.Popen) -> None:
        self.task = task
        self.proc = proc
        # A pidfd turns "the process exited" into an fd event: the supervisor's select loop
        # learns of an exit at once, with no polling sleep in the way.
        self.exit_fd = os.pidfd_open(proc.pid)

    @property
    def pid(self) -> int:
        """The task's pid, which is also its process group id."""
        return self.proc.pid

    def returncode(self) -> int | None:
        """Reap the process if it has exited; its return code, or None while it runs."""
        return self.proc.poll()

    def joined(self) -> bool:
        """Whether the task's TensorFlow server listens on its port."""
        return procs.listening(self.proc.pid, self.task.port)

    def close(self) -> None:
        """Release the pidfd."""
        os.close(self.exit_fd)


class LocalTransport:
    """Starts and stops tasks as local process groups."""

    def start(self, task: TaskPlan) -> LocalHandle:
        """Start one task; its output goes to its log file."""
        return LocalHandle(task, procs.spawn(task.argv, task.env, task.cwd, task.log_file))

    def stop(self, handles: Sequence[LocalHandle], grace_s: float) -> None:
        """Stop the tasks' process groups: SIGTERM, ``grace_s``, SIGKILL."""
        procs.stop_groups([h.proc for h in handles], grace_s)
