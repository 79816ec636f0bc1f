"""Warm standbys: per local task, an interpreter that has already imported TensorFlow and waits to
become the task's next attempt, so that a restart costs a cluster join and a checkpoint restore,
not a new Python importing TensorFlow (3.7-5 s per process on the development machine).

A standby is the task's next attempt started early and held at the door. It runs the task's own
command, ``bootstrap.py SCRIPT ARGS...`` (a PSS server task's ``-m distlaunch.worker.serve``
through the bootstrap too), under taskinit like every task (its own PID namespace, the run's
network namespace, the parent-death signal: it dies with the launcher and nothing it starts
outlives it), and with exactly the env, cwd and output of that attempt: the same TF_CONFIG, the
next DISTLAUNCH_ATTEMPT and error file, that attempt's log; plus DISTLAUNCH_STANDBY, which the
bootstrap removes first: its control socket and the env writes the program makes before its
TensorFlow import (launcher/plan/program_env.py, read from the source when the standby starts). The
bootstrap makes those writes for its imports and undoes them, so TensorFlow reads at import
what a cold start gives it, and the program cannot tell (the bootstrap sets ``sys.argv``,
``sys.path[0]`` and ``__main__`` only as a cold start would). A program whose writes cannot be
repeated gets no standby: it restarts cold (`plan` says why).

No trace unless used: its log is an unnamed file (O_TMPFILE) in RUN/logs, linked to the attempt's
log path when the standby becomes the task; the attempt's other files (stacks, errors) are made
by the program after go. An unused standby is SIGKILLed (with its PID namespace) and its file
vanishes with the last descriptor. Where the run dir's filesystem has no unnamed files, or a
standby dies unused, that task restarts cold.

The supervisor says when and for which attempt (`prepare`): once the cluster has settled, for
the attempt after the current one. Every restart is a new attempt (the run's attempt counter is
shared by all tasks), so after each restart every standby is stale and is replaced, the used ones
included. The local transport `take`s the standby made for exactly the task plan it must start,
or starts the task cold.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from distlaunch.host import bootstrap
from distlaunch.launcher.core.backends import TaskTransport
from distlaunch.launcher.network.netns import Sandbox
from distlaunch.launcher.plan import program_scan
from distlaunch.launcher.plan.plan import TaskPlan
from distlaunch.launcher.plan.program_env import StandbyEnv
from distlaunch.launcher.plan.program_scan import SERVE_MODULE
from distlaunch.launcher.record import rundir
from distlaunch.launcher.transports import procs
from distlaunch.launcher.transports.standby_rule import ReconciledPool

if TYPE_CHECKING:
    import socket

# socket is imported by the methods that use it: standbys are made seconds after a run's tasks
# have started, and loading it with this module would delay the first of them (bench/startup.py).


@dataclass
class _Standby:
    task: TaskPlan  # the attempt it was made for
    proc: subprocess.Popen  # taskinit's keeper
    tree_fd: int  # reads EOF once every process of the standby is gone
    log_fd: int  # its unnamed log file
    control: socket.socket  # our end: it says ready, we say go (or close: it exits)
    ready: bool = False

    def alive(self) -> bool:
        return self.proc.poll() is None


def standby_start(task: TaskPlan, fd: int) -> tuple[tuple[str, ...], dict[str, str]] | None:
    """The command and env of a standby for local ``task``, talking on socket ``fd``; None for a
    task no standby can stand in for (not a bootstrap or server command, or a program whose env
    writes before its TensorFlow import cannot be repeated)."""
    python, *rest = task.argv
    if rest[:1] == [bootstrap.__file__]:
        argv = tuple(task.argv)
        env = program_scan.standby_env(rest[1:], task.cwd)
    elif rest[:2] == ["-m", SERVE_MODULE]:
        argv = (python, bootstrap.__file__, *rest)
        env = StandbyEnv()
    else:
        return None
    if env.cold:
        return None
    order = {"fd": fd, "env": [w.to_json() for w in env.writes]}
    return argv, {**task.env, bootstrap.STANDBY_ENV: json.dumps(order)}


class Standbys(ReconciledPool["_Standby"]):
    """The run's standbys (a `transports.base.StandbyPool`), at most one per task; ``sandbox`` is
    the run's network namespace."""

    kind = TaskTransport.LOCAL

    def __init__(self, sandbox: Sandbox | None = None) -> None:
        super().__init__()
        self.sandbox = sandbox

    def take(self, task: TaskPlan) -> tuple[subprocess.Popen, int] | None:
        """Make the standby of ``task`` (this very plan) the task: link its log, tell it to go,
        and return its process and tree descriptor; None when there is none to use."""
        standby = self._standbys.pop(task.name, None)
        if standby is None:
            return None
        if standby.task != task or not standby.alive():
            self._discard(standby)
            return None
        try:
            # Linked first: the log exists under its name before the program writes a line.
            _link(standby.log_fd, task.log_file)
        except OSError:
            self._discard(standby)
            return None
        try:
            standby.control.sendall(bootstrap.GO)
        except OSError:  # it died just now: the cold start must find no log of it
            os.unlink(task.log_file)
            self._discard(standby)
            return None
        os.close(standby.log_fd)
        standby.control.close()
        return standby.proc, standby.tree_fd

    def poll(self) -> None:
        """Note which standbys have finished their imports (for run.json); drop dead ones."""
        import socket

        for name, standby in list(self._standbys.items()):
            if standby.ready:
                continue
            try:
                said = standby.control.recv(1, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            standby.ready = said == bootstrap.READY
            if not said:  # EOF: it died during its imports; this task restarts cold
                self._cold.add(name)
                self._discard(self._standbys.pop(name))

    def record(self) -> dict:
        """run.json's ``standbys``: per task, the standby's pid (taskinit's keeper), the attempt
        it was made for, whether it has imported TensorFlow and the CPUs it is pinned to."""
        return {
            name: {
                "pid": s.proc.pid,
                "attempt": s.task.attempt,
                "ready": s.ready,
                "cpus": list(s.task.cpus.ids),
            }
            for name, s in self._standbys.items()
        }

    def close(self) -> None:
        """Kill every standby; return once nothing of theirs is left."""
        standbys = list(self._standbys.values())
        self._standbys.clear()
        procs.kill_groups(s.proc for s in standbys)
        for standby in standbys:
            self._discard(standby)

    def _make(self, task: TaskPlan) -> _Standby | None:
        """Start a standby for ``task`` in the run's namespace, pinned like the task (None: it
        cannot be made)."""
        import socket

        if self.sandbox is not None and not self.sandbox.alive():
            return None  # the supervisor learns of it from the tasks
        logs = Path(task.log_file).parent.parent  # RUN/logs: this attempt's folder comes later
        try:
            log_fd = os.open(logs, os.O_TMPFILE | os.O_WRONLY | os.O_APPEND, rundir.file_mode(logs))
        except OSError:
            return None
        ours, theirs = socket.socketpair()  # both close-on-exec: only the standby gets its end
        try:
            start = standby_start(task, theirs.fileno())
            if start is None:
                raise OSError(f"no standby for {task.argv[:3]}")
            namespaces = self.sandbox.namespaces() if self.sandbox is not None else None
            # Pinned like the task: TensorFlow sizes its pools at import, which the standby
            # has done before it is told to go (and `take` serves only this very plan).
            proc, tree_fd = procs.spawn_contained(
                *start, task.cwd, log_fd, namespaces, [theirs.fileno()], task.cpus.ids
            )
        except OSError:
            os.close(log_fd)
            ours.close()
            return None
        finally:
            theirs.close()
        return _Standby(task, proc, tree_fd, log_fd, ours)

    def _discard(self, standby: _Standby) -> None:
        procs.kill_groups([standby.proc])
        procs.wait_tree(standby.tree_fd)
        os.close(standby.tree_fd)
        os.close(standby.log_fd)
        standby.control.close()


def _link(fd: int, path: str) -> None:
    """Give the unnamed file open as ``fd`` the name ``path`` (linkat with AT_SYMLINK_FOLLOW on
    /proc/self/fd, which needs no privilege; os.link uses plain link() unless given a dir fd)."""
    folder = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.link(f"/proc/self/fd/{fd}", os.path.basename(path), dst_dir_fd=folder)
    finally:
        os.close(folder)
