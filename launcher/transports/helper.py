"""The helper transport: a task on another machine runs under `distlaunch.worker.remote`, held by a
local client process whose stdin reaches the helper (ssh to a host, srun to a Slurm node).

What every such transport shares is here; a backend only says how the helper is started
(`HelperTransport.helper_command`), how its clients are ended at once (`kill`) and where a
task's stacks are read (`stacks`):
- The client is a *local* child process, started like a local task (own process group, dies with
  the launcher by PR_SET_PDEATHSIG, output appended to the task's log file). The task's argv,
  environment and working dir reach the helper as one JSON line on its stdin
  (`HelperTransport.request`): no spec value is ever parsed by a shell.
- The launcher keeps the client's stdin: a heartbeat line every HEARTBEAT_S
  (launcher/network/heartbeat.py), ``stop`` to end the task (SIGTERM, grace, SIGKILL where it
  runs), and ``notice`` for a stop notice (SIGTERM to the task's program alone, where it runs).
  EOF or HEARTBEAT_TIMEOUT_S of silence makes the helper SIGKILL the task's process group there
  at once, as the kernel does to a local task whose launcher dies: nothing is left running on the
  machine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from distlaunch.launcher.diagnosis import stacks
from distlaunch.launcher.network.heartbeat import HEARTBEAT_TIMEOUT_S, Heartbeat, Pipe
from distlaunch.launcher.plan.plan import TaskPlan
from distlaunch.launcher.record import rundir
from distlaunch.launcher.transports import procs
from distlaunch.worker import contract, remote

HELPER_MODULE = "distlaunch.worker.remote"
# After `stop`, the helper takes grace_s to end the task; this is added for the network.
STOP_MARGIN_S = 5.0
JOIN_CONNECT_TIMEOUT_S = 0.5
# How much of a task's log end is read for the helper's last line (`log_ends_with_death`).
_TAIL_BYTES = 4096
# Run files a task writes; on machines that do not share the run dir the helper creates their folders.
_TASK_FILES = (contract.ERROR_FILE, contract.STATUS_FILE, contract.METRICS_FILE)


def still_running(handles: Sequence[HelperHandle], timeout_s: float) -> list[subprocess.Popen]:
    """Wait up to ``timeout_s`` (for all of them together) for the handles' local clients to
    exit; the clients still running then."""
    deadline = time.monotonic() + timeout_s
    late = []
    for handle in handles:
        try:
            handle.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            late.append(handle.proc)
    return late


@dataclass(frozen=True)
class HelperCommand:
    """How one task's helper is started: the local client's command line, what is added to the
    launcher's environment for it, and the signal it gets when the launcher dies."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    death_signal: signal.Signals = signal.SIGKILL


class HelperHandle(procs.TaskProcess):
    """One task running under a remote helper, seen through its local client process (ssh, srun).

    ``returncode`` is the task's exit code as the helper relayed it (128+N for signal N; 255 over
    SSH: ssh failed).
    """

    def __init__(self, task: TaskPlan, proc: subprocess.Popen, request: bytes) -> None:
        super().__init__(task, proc)
        # The request fits in the pipe's buffer, so this write does not wait for the connection.
        self.stdin = Pipe(proc, request)

    def exit_status(self) -> int | None:
        """The task's exit code, with a death by SIGTERM as -15, as a local task's: the helper
        relays it as 143 (neither SSH nor srun carries a signal death), which after a stop notice
        would read as a program that saved on its own SIGTERM handler (contract.EXIT_CODES). The
        helper's last line in the log tells the two apart."""
        code = super().exit_status()
        if code == 128 + signal.SIGTERM and log_ends_with_death(self.task.log_file):
            return -signal.SIGTERM
        return code

    def joined(self) -> bool:
        """Whether the task's TensorFlow server accepts connections on host:port.

        A TCP connect from the launcher, which runs on one of the cluster's machines; a connection
        opened and closed at once is harmless to a gRPC server.
        """
        try:
            with socket.create_connection(
                (self.task.host, self.task.port), timeout=JOIN_CONNECT_TIMEOUT_S
            ):
                return True
        except OSError:
            return False

    def close(self) -> None:
        """Release the pidfd and the helper's stdin (EOF ends the remote task if it still runs)."""
        self.stdin.close()
        super().close()


def log_ends_with_death(log_file: str) -> bool:
    """Whether the helper's last line in ``log_file`` says its task died of SIGTERM."""
    try:
        with open(log_file, "rb") as log:
            log.seek(max(0, os.fstat(log.fileno()).st_size - _TAIL_BYTES))
            return remote.ended_by(log.read(), signal.SIGTERM)
    except OSError:
        return False


def request_of(task: TaskPlan, umask: int | None, grace_s: float) -> dict:
    """The JSON request a task's remote helper (`distlaunch.worker.remote`) reads: the task as
    data, with the folders of its run files to create there."""
    folders = {str(Path(task.env[name]).parent) for name in _TASK_FILES if name in task.env}
    folders |= {
        task.env[name] for name in (contract.RUN_DIR, contract.CHECKPOINT_DIR) if name in task.env
    }
    return {
        "argv": list(task.argv),
        "env": dict(task.env),
        "cwd": task.cwd or None,
        "mkdirs": sorted(folders),
        "umask": umask,
        "grace_s": grace_s,
        "heartbeat_s": HEARTBEAT_TIMEOUT_S,
        "cpus": list(task.cpus.ids),
    }


class HelperTransport(ABC):
    """Starts tasks under remote helpers and stops them (where they run: TERM, grace, KILL).

    A subclass says how a task's helper is started (`helper_command`), how its clients are ended
    at once (`kill`) and where a task's stacks are read (`stacks`)."""

    def __init__(self, grace_s: float, umask: int | None, heartbeat: str) -> None:
        self.grace_s = grace_s
        self.umask = umask
        self._heartbeat = Heartbeat(heartbeat)

    @abstractmethod
    def helper_command(self, task: TaskPlan) -> HelperCommand:
        """The local client that runs ``task``'s helper on its machine."""

    @abstractmethod
    def kill(self, handles: Sequence[HelperHandle]) -> None:
        """End the tasks now: their helpers SIGKILL them where they run."""

    @abstractmethod
    def stacks(self, handle: HelperHandle, native: bool) -> stacks.Source:
        """The task's program, read where it runs (never its local client)."""

    def start(self, task: TaskPlan) -> HelperHandle:
        """Start one task on its machine; its client's output is appended to its local log file."""
        command = self.helper_command(task)
        rundir.create_file(task.log_file)
        proc = procs.spawn(
            command.argv,
            command.env,
            os.getcwd(),
            task.log_file,
            stdin=subprocess.PIPE,
            death_signal=command.death_signal,
        )
        handle = HelperHandle(task, proc, json.dumps(self.request(task)).encode() + b"\n")
        self._heartbeat.add(handle.stdin)
        return handle

    def request(self, task: TaskPlan) -> dict:
        """The JSON request the remote helper (`distlaunch.worker.remote`) reads: the task as data."""
        return request_of(task, self.umask, self.grace_s)

    def stop(self, handles: Sequence[HelperHandle], grace_s: float) -> None:
        """Ask every task's helper to stop it (SIGTERM, ``grace_s``, SIGKILL where it runs), wait
        that long plus a margin for the local clients to end, then `kill` what is left."""
        for handle in handles:
            handle.stdin.send(b"stop\n")
        still_running(handles, grace_s + STOP_MARGIN_S)
        self.kill(handles)

    def notify(self, handles: Sequence[HelperHandle]) -> bool:
        """Send every task's helper a stop notice (a `NoticeTransport`'s notify, for SSH hosts and
        Slurm nodes alike): it sends SIGTERM to the task's program alone, where it runs (never to
        what the program forked), and goes on watching it."""
        for handle in handles:
            handle.stdin.send(b"notice\n")
        return True

    def close(self) -> None:
        """Stop the heartbeat (the tasks must be stopped already)."""
        self._heartbeat.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
