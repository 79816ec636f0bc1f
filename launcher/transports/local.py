"""The local transport: tasks as child processes of the launcher on this machine."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from distlaunch.launcher import procs, rundir
from distlaunch.launcher.plan import TaskPlan
from distlaunch.launcher.standby import Standbys
from distlaunch.launcher.transports.netns import Sandbox, SandboxLost


class LocalHandle(procs.TaskProcess):
    """One running local task: the task's own process."""

    def __init__(
        self,
        task: TaskPlan,
        proc: subprocess.Popen,
        tree_fd: int,
        sandbox: Sandbox | None = None,
        warm: bool = False,
    ) -> None:
        super().__init__(task, proc, tree_fd)
        self.warm = warm
        # Any process in the task's network namespace shows its sockets; the sandbox's holder is
        # in it from the start, while the task itself is only once taskinit has entered it.
        self.sandbox = sandbox

    def joined(self) -> bool:
        """Whether the task's TensorFlow server listens on its port."""
        if self.sandbox is None:
            return procs.listening(self.proc.pid, self.task.port)
        if not self.sandbox.alive():  # its pid may be another process's by now
            raise SandboxLost(self.sandbox.dead_message())
        return procs.listening(self.sandbox.pid, self.task.port)


class LocalTransport:
    """Starts and stops tasks as local process groups, inside ``sandbox`` when the run has one.

    Each task runs in a PID namespace of its own (procs.spawn_contained): whatever it forked dies
    with it, and a task is started again only once all of its predecessor is gone, so no child of
    the last attempt can hold its port.

    With ``standby`` a restarted task starts from its warm standby where one was made for it
    (launcher/standby.py; the supervisor decides when ``standbys`` makes them).
    """

    def __init__(self, sandbox: Sandbox | None = None, standby: bool = False) -> None:
        self.sandbox = sandbox
        self._last: dict[str, LocalHandle] = {}
        self.standbys = Standbys(sandbox) if standby else None

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
                task.argv, task.env, task.cwd, task.log_file, namespaces
            )
        handle = LocalHandle(task, proc, tree_fd, self.sandbox, warm=warm is not None)
        self._last[task.name] = handle
        return handle

    def stop(self, handles: Sequence[LocalHandle], grace_s: float) -> None:
        """Stop the tasks: SIGTERM, ``grace_s``, SIGKILL; return once nothing of theirs is left."""
        procs.stop_groups([h.proc for h in handles], grace_s)
        for handle in handles:
            handle.wait_tree()

    def kill(self, handles: Sequence[LocalHandle]) -> None:
        """SIGKILL the tasks now and reap them; return once nothing of theirs is left."""
        procs.kill_groups(h.proc for h in handles)
        for handle in handles:
            handle.wait_tree()
