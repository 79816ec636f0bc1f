"""The SSH transport: a task on another host runs there under `distlaunch.worker.remote`, held by a local ssh client.

Why it is built this way:
- The system's OpenSSH client does the connecting, so ~/.ssh/config, agents, ProxyJump and
  known_hosts behave as the user expects. BatchMode: it fails instead of prompting. Host keys are
  checked (``accept-new`` only where the spec opts in).
- Connections are shared: ControlMaster=auto with its sockets in a private 0700 dir of the run.
  Preflight's ssh opens each host's master connection and every task's session rides on it, so N
  tasks cost one handshake. A master carries at most MUX_SESSIONS tasks (sshd's default
  MaxSessions is 10); more tasks on one host open more masters. `Session.close` ends them
  (`ssh -O exit`); ControlPersist is short, so a master left by a killed launcher ends on its own
  once its sessions are gone.
- Each task is a *local* child process, started like a local task (own process group, killed
  with the launcher by PR_SET_PDEATHSIG, output appended to the task's log file):
  ``ssh HOST 'exec PYTHON -m distlaunch.worker.remote'``. The task's argv, environment and working
  dir reach the helper as one JSON line on its stdin: no spec value is ever parsed by a shell.
  Only the interpreter's path is in the remote command, shell-quoted.
- The launcher keeps the ssh client's stdin. It writes a heartbeat line every HEARTBEAT_S, and
  ``stop`` to end the task (SIGTERM, grace, SIGKILL there). EOF (the launcher died or killed the
  client, the connection dropped) or HEARTBEAT_TIMEOUT_S of silence (the network vanished without
  a reset) makes the helper SIGKILL the task's remote process group at once, as the kernel does
  to a local task whose launcher dies: nothing is left running on the host.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from distlaunch.launcher import procs, rundir, stacks
from distlaunch.launcher.plan import TaskPlan
from distlaunch.launcher.spec import Host
from distlaunch.worker import contract

# Tasks per master connection: sshd refuses sessions past MaxSessions (10 by default) on one
# connection; one is kept spare for preflight and `collect`.
MUX_SESSIONS = 8
# How long an idle master outlives its last session when nobody ends it (`ssh -O exit`).
CONTROL_PERSIST_S = 30
# The local client gives up on a silent server after ALIVE_INTERVAL_S * ALIVE_COUNT seconds.
ALIVE_INTERVAL_S = 5
ALIVE_COUNT = 3
HEARTBEAT_S = 2.0
HEARTBEAT_TIMEOUT_S = 20.0
# After `stop`, the helper takes grace_s to end the task; this is added for the network.
STOP_MARGIN_S = 5.0
JOIN_CONNECT_TIMEOUT_S = 0.5
HELPER_MODULE = "distlaunch.worker.remote"
# The master connection of the launcher's stacks queries, apart from the tasks': a capture asks
# about up to 8 tasks of a host at once, which would not fit beside 8 tasks on one master.
STACKS_SLOT = -1
# Run files a task writes; on hosts that do not share the run dir the helper creates their folders.
_TASK_FILES = (contract.ERROR_FILE, contract.STATUS_FILE, contract.METRICS_FILE)


def remote_python(python: str) -> str:
    """``python`` as a word of a remote POSIX shell command: quoted, with a leading ``~/`` expanded.

    Everything else is quoted verbatim, so the spec's value is data, never shell code.
    """
    if python.startswith("~/"):
        return '"$HOME"/' + shlex.quote(python[2:])
    return shlex.quote(python)


def jumped_hosts(hosts: Mapping[str, Host]) -> list[str]:
    """The SSH hosts among ``hosts`` that ssh reaches through a jump host (`Session.through_jump_host`)."""
    session = Session({n: h for n, h in hosts.items() if h.transport == "ssh"})
    return [name for name in sorted(session.hosts) if session.through_jump_host(name)]


def helper_request(task: TaskPlan, umask: int | None, grace_s: float) -> dict:
    """The JSON request the remote helper (`distlaunch.worker.remote`) reads: the task as data."""
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
    }


class Session:
    """The SSH side of one run: a private control-socket dir and the master connections in it."""

    def __init__(self, hosts: Mapping[str, Host]) -> None:
        self.hosts = dict(hosts)
        self._control_dir: str | None = None
        self._masters: set[tuple[str, int]] = set()
        self._lock = threading.Lock()

    def target(self, name: str) -> str:
        """The host as people read it: ``name (user@address:port)``."""
        host = self.hosts[name]
        where = f"{host.user}@" if host.user else ""
        where += host.address_of(name) + (f":{host.port}" if host.port else "")
        return f"{name} ({where})"

    def argv(self, name: str, remote_command: str, slot: int = 0) -> list[str]:
        """The ssh command line that runs ``remote_command`` (POSIX shell text) on host ``name``.

        ``slot`` picks the master connection: slot k carries tasks k*MUX_SESSIONS onwards.
        """
        return [
            "ssh",
            "-T",
            *self._options(name, slot),
            "--",
            self.hosts[name].address_of(name),
            remote_command,
        ]

    def run(
        self,
        name: str,
        remote_command: str,
        stdin: bytes = b"",
        timeout: float | None = None,
        slot: int = 0,
    ) -> subprocess.CompletedProcess:
        """Run ``remote_command`` on host ``name`` and wait; output is captured as bytes.

        The first call for a host (and slot) opens its master connection, which stays for the run.
        """
        host = self.hosts[name]
        return subprocess.run(
            self.argv(name, remote_command, slot),
            input=stdin,
            capture_output=True,
            timeout=timeout if timeout is not None else host.connect_timeout_s + 60,
        )

    def through_jump_host(self, name: str) -> bool:
        """Whether ssh reaches host ``name`` through a jump host (ProxyJump or ProxyCommand, from
        the spec's options or the user's ssh config): `ssh -G` prints the options it would use and
        connects nowhere. Its guard then sees the jump host as the SSH session's source."""
        host = self.hosts[name]
        argv = ["ssh", "-G", *self._options(name, 0, control=False), "--", host.address_of(name)]
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
        except subprocess.TimeoutExpired:
            return False
        for line in done.stdout.decode(errors="replace").splitlines():
            key, _, value = line.partition(" ")
            if key in ("proxyjump", "proxycommand") and value.strip().lower() != "none":
                return True
        return False

    def close(self) -> None:
        """End every master connection this session opened and remove the control dir."""
        if self._control_dir is None:
            return
        for name, slot in sorted(self._masters):
            host = self.hosts[name]
            try:
                # Without a master (the host was never reached) this fails at once, harmlessly.
                subprocess.run(
                    ["ssh", *self._options(name, slot), "-O", "exit", "--", host.address_of(name)],
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    timeout=host.connect_timeout_s + 10,
                )
            except subprocess.TimeoutExpired:
                pass  # a master that hangs goes away by itself ControlPersist after its last session
        shutil.rmtree(self._control_dir, ignore_errors=True)
        self._control_dir = None
        self._masters.clear()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _options(self, name: str, slot: int, control: bool = True) -> list[str]:
        host = self.hosts[name]
        # The spec's own options first: ssh keeps the first value it is given for an option, so
        # they override the defaults below (owned options are refused by the spec).
        opts: list[str] = []
        for option in host.ssh_options:
            opts += ["-o", option]
        if host.identity_file:
            opts += ["-i", host.identity_file, "-o", "IdentitiesOnly=yes"]
        if host.user:
            opts += ["-l", host.user]
        if host.port:
            opts += ["-p", str(host.port)]
        opts += [
            "-o",
            "BatchMode=yes",
            "-o",
            f"ConnectTimeout={host.connect_timeout_s}",
            "-o",
            f"StrictHostKeyChecking={host.host_key_checking}",
        ]
        if not control:
            return opts
        with self._lock:
            if self._control_dir is None:
                # Short, private and per run: a socket path must fit in 108 bytes, and whoever can
                # reach a control socket can run commands on the host.
                self._control_dir = tempfile.mkdtemp(prefix="distlaunch-ssh-")
            self._masters.add((name, slot))
        opts += [
            "-o",
            "ControlMaster=auto",
            # Per host name, not only per user@address:port (%C): two names for one machine may
            # differ in key or options, and must not ride on each other's connection.
            "-o",
            f"ControlPath={self._control_dir}/{sorted(self.hosts).index(name)}-{slot}-%C",
            "-o",
            f"ControlPersist={CONTROL_PERSIST_S}",
            "-o",
            f"ServerAliveInterval={ALIVE_INTERVAL_S}",
            "-o",
            f"ServerAliveCountMax={ALIVE_COUNT}",
        ]
        return opts


def task_stacks(
    session: Session, host: str, run_id: str, task: str, native: bool, slot: int = 0
) -> stacks.Source:
    """Where the stacks of ``task`` on SSH host ``host`` are read: on that host, by the remote
    helper (py-spy there; else the program's own faulthandler, signalled there). The local ssh
    client that stands for the task is never read or signalled: it is not the program, and a
    signal would end it, and with it the task."""
    python = remote_python(session.hosts[host].python)
    argv = session.argv(host, f"exec {python} -m {HELPER_MODULE}", slot)
    return stacks.helper(argv, run_id, task, native, f"on {session.target(host)}")


class SshHandle(procs.TaskProcess):
    """One task running on an SSH host, seen through its local ssh client process.

    ``returncode`` is the task's exit code as the helper relayed it (128+N for signal N; 255: ssh
    failed).
    """

    def __init__(self, task: TaskPlan, proc: subprocess.Popen) -> None:
        super().__init__(task, proc)
        assert proc.stdin is not None
        self._stdin: int | None = proc.stdin.fileno()
        # The heartbeat thread writes while the main thread may close: an fd closed under a
        # writer could be reused by another file and written to.
        self._lock = threading.Lock()

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

    def send(self, line: bytes) -> None:
        """Write one line to the helper; a client that is gone is not an error here (its exit is)."""
        with self._lock:
            if self._stdin is None:
                return
            try:
                os.write(self._stdin, line)
            except (BrokenPipeError, BlockingIOError):
                pass

    def close_stdin(self) -> None:
        """Close the helper's stdin: EOF makes it SIGKILL the task at once if it still runs."""
        with self._lock:
            if self._stdin is not None:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self._stdin = None

    def close(self) -> None:
        """Release the pidfd and the helper's stdin (EOF ends the remote task if it still runs)."""
        self.close_stdin()
        super().close()


def ask_to_stop(handles: Sequence[SshHandle], grace_s: float) -> None:
    """Ask every task's remote helper to stop it (SIGTERM, ``grace_s``, SIGKILL where it runs) and
    wait that long plus a margin for the local processes to end; the caller kills what is left."""
    for handle in handles:
        handle.send(b"stop\n")
    deadline = time.monotonic() + grace_s + STOP_MARGIN_S
    for handle in handles:
        try:
            handle.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


class SshTransport:
    """Starts tasks on SSH hosts through `session` and stops them (remotely: TERM, grace, KILL)."""

    def __init__(self, session: Session, grace_s: float, umask: int | None) -> None:
        self.session = session
        self.grace_s = grace_s
        self.umask = umask
        self._slots: dict[str, int] = {}
        self._per_host: dict[str, int] = {}
        self._opened: set[tuple[str, int]] = set()
        self._live: set[SshHandle] = set()
        self._lock = threading.Lock()
        self._quit = threading.Event()
        self._heart: threading.Thread | None = None

    def start(self, task: TaskPlan) -> SshHandle:
        """Start one task on its host; its output is appended to its local log file."""
        slot = self._slot(task)
        if slot > 0 and (task.host_name, slot) not in self._opened:
            # Opened before the slot's first task, so that its tasks do not race to be master.
            self._opened.add((task.host_name, slot))
            try:
                self.session.run(task.host_name, "true", slot=slot)
            except subprocess.TimeoutExpired:
                pass  # the task's own ssh then reports what is wrong
        rundir.create_file(task.log_file)
        command = (
            f"exec {remote_python(self.session.hosts[task.host_name].python)} -m {HELPER_MODULE}"
        )
        # The client gets the launcher's environment (agent socket, ssh config) plus the run id that
        # `distlaunch down` looks for; the task's own environment travels in the request.
        env = {contract.RUN_ID: task.env.get(contract.RUN_ID, "")}
        proc = procs.spawn(
            self.session.argv(task.host_name, command, slot),
            env,
            os.getcwd(),
            task.log_file,
            stdin=subprocess.PIPE,
        )
        handle = SshHandle(task, proc)
        # The request fits in the pipe's buffer, so this write does not wait for the connection.
        handle.send(json.dumps(self.request(task)).encode() + b"\n")
        assert proc.stdin is not None
        os.set_blocking(proc.stdin.fileno(), False)
        with self._lock:
            self._live.add(handle)
            if self._heart is None:
                self._heart = threading.Thread(target=self._beat, name="ssh-heartbeat", daemon=True)
                self._heart.start()
        return handle

    def request(self, task: TaskPlan) -> dict:
        """The JSON request the remote helper reads: the task as data."""
        return helper_request(task, self.umask, self.grace_s)

    def stop(self, handles: Sequence[SshHandle], grace_s: float) -> None:
        """Ask every helper to stop its task (SIGTERM, grace, SIGKILL on the host), wait, then
        kill the local clients still running: their EOF makes the helpers kill at once."""
        ask_to_stop(handles, grace_s)
        self.kill(handles)

    def kill(self, handles: Sequence[SshHandle]) -> None:
        """Kill the tasks' local ssh clients: the helpers see EOF and SIGKILL their tasks at once."""
        procs.kill_groups(h.proc for h in handles)

    def stacks(self, handle: SshHandle, native: bool) -> stacks.Source:
        """The task's program, read on its host (see `task_stacks`)."""
        task = handle.task
        run_id = task.env.get(contract.RUN_ID, "")
        return task_stacks(self.session, task.host_name, run_id, task.name, native, STACKS_SLOT)

    def close(self) -> None:
        """Stop the heartbeat (the tasks must be stopped already)."""
        self._quit.set()
        if self._heart is not None:
            self._heart.join()

    def __enter__(self) -> SshTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _slot(self, task: TaskPlan) -> int:
        """The master connection a task uses, stable across restarts of the task."""
        key = f"{task.host_name}/{task.name}"
        if key not in self._slots:
            count = self._per_host.get(task.host_name, 0)
            self._per_host[task.host_name] = count + 1
            self._slots[key] = count // MUX_SESSIONS
        return self._slots[key]

    def _beat(self) -> None:
        while not self._quit.wait(HEARTBEAT_S):
            with self._lock:
                live = [h for h in self._live if h.proc.poll() is None]
                self._live = set(live)
            for handle in live:
                handle.send(b"\n")
