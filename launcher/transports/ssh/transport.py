"""The SSH transport: a task on another host runs there under `distlaunch.host.remote`, held by a local ssh client.

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
- Each task is a helper transport's task (transports/helper.py): a local ssh client runs
  ``ssh HOST 'exec PYTHON -m distlaunch.host.remote'`` and the task travels as one JSON line on
  its stdin. Only the interpreter's path is in the remote command, shell-quoted. The launcher keeps
  the client's stdin (heartbeats, ``stop``); EOF (the launcher died or killed the client, the
  connection dropped) or the heartbeat's silence makes the helper SIGKILL the task's remote
  process group at once: nothing is left running on the host.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from distlaunch.launcher.diagnosis import stacks
from distlaunch.launcher.plan.plan import TaskPlan
from distlaunch.launcher.spec.model import Host
from distlaunch.launcher.transports.agent import (
    AGENT_MODULE,
    AgentCommand,
    AgentHandle,
    AgentTransport,
)
from distlaunch.launcher.transports.helper import HELPER_MODULE
from distlaunch.worker import contract

# Sessions one master connection carries at most at once: sshd refuses sessions past MaxSessions
# (10 by default) on one connection. The run's master carries the agent (the host's guard too), so the
# stacks queries (up to this many at once) ride a master of their own (STACKS_SLOT).
MUX_SESSIONS = 8
# How long an idle master outlives its last session when nobody ends it (`ssh -O exit`).
CONTROL_PERSIST_S = 30
# The local client gives up on a silent server after ALIVE_INTERVAL_S * ALIVE_COUNT seconds.
ALIVE_INTERVAL_S = 5
ALIVE_COUNT = 3
# The master connection of the launcher's stacks queries, apart from the tasks': a capture asks
# about up to 8 tasks of a host at once, which would not fit beside 8 tasks on one master.
STACKS_SLOT = -1
# The most ssh clients a launcher runs at once for per-host work (`ssh -G`, `ssh -O exit`).
PARALLEL_SSH = 32

A = TypeVar("A")
T = TypeVar("T")


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
    names = sorted(session.hosts)
    # One `ssh -G` per host, side by side: one after another they cost a run of 100 hosts seconds.
    found = _each(session.through_jump_host, names)
    return [name for name, jumped in zip(names, found, strict=True) if jumped]


def _each(work: Callable[[A], T], items: Sequence[A]) -> list[T]:
    """``work`` of every item, at most PARALLEL_SSH at once (each mostly waits on an ssh client)."""
    if len(items) < 2:
        return [work(item) for item in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(PARALLEL_SSH, len(items))) as pool:
        return list(pool.map(work, items))


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

        ``slot`` picks the master connection: 0 is the run's (the agent's, which is the guard).
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

    def probe_argv(self, name: str) -> list[str]:
        """The ssh command line that runs ``true`` on host ``name`` over a connection of its
        own (an elastic run's probe of a lost host)."""
        host = self.hosts[name]
        options = self._options(name, 0, control=False)
        return ["ssh", "-T", *options, "--", host.address_of(name), "true"]

    def close(self) -> None:
        """End every master connection this session opened and remove the control dir."""
        if self._control_dir is None:
            return
        # All at once: the launcher's exit waits for the last of them.
        _each(self._end_master, sorted(self._masters))
        shutil.rmtree(self._control_dir, ignore_errors=True)
        self._control_dir = None
        self._masters.clear()

    def _end_master(self, master: tuple[str, int]) -> None:
        name, slot = master
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


class SshTransport(AgentTransport):
    """Starts tasks on SSH hosts through one agent per host, each behind one ssh session."""

    def __init__(
        self, session: Session, grace_s: float, umask: int | None, run_id: str = ""
    ) -> None:
        super().__init__(grace_s, umask)
        self.session = session
        self.run_id = run_id  # for `distlaunch down`, on the agents' clients

    def agent_command(self, machine: str) -> AgentCommand:
        """The host's agent, on the host's master connection (opened by it if it is the first)."""
        python = remote_python(self.session.hosts[machine].python)
        # The client gets the launcher's environment (agent socket, ssh config) plus the run id
        # that `distlaunch down` looks for; the tasks' own environments travel in the requests.
        env = {contract.RUN_ID: self.run_id}
        argv = self.session.argv(machine, f"exec {python} -m {AGENT_MODULE}")
        return AgentCommand(tuple(argv), env, self.session.target(machine))

    def probe_argv(self, machine: str) -> list[str] | None:
        """``ssh HOST true`` on a connection of its own (no master: one left from before the
        host's loss would answer for it), host keys checked as for the run."""
        return self.session.probe_argv(machine)

    def start(self, task: TaskPlan) -> AgentHandle:
        """Start one task through its host's agent."""
        self.run_id = task.env.get(contract.RUN_ID, "")
        return super().start(task)

    def stacks(self, handle: AgentHandle, native: bool) -> stacks.Source:
        """The task's program, read on its host (see `task_stacks`)."""
        task = handle.task
        run_id = task.env.get(contract.RUN_ID, "")
        return task_stacks(self.session, task.host_name, run_id, task.name, native, STACKS_SLOT)
