"""The agent transport: one agent per remote machine (`distlaunch.host.agent`) starts and watches
all of that machine's tasks, over the one channel of one local client (an ssh session).

A backend says how a machine's agent is started (`AgentTransport.agent_command`) and where a task's
stacks are read (`stacks`); the rest is here:
- `AgentLink` (agent_link.py) is one machine's agent: its local client, started like a local
  task (own process group, dies with the launcher by its parent-death signal), whose stdin carries
  the launcher's commands (start, stop, notice, kill, heartbeats) and whose stdout the agent's
  frames (each task's output, its start, its end). The first task of a machine starts its agent; every other
  task's start is one more line on the same channel, so a machine's tasks start side by side.
- `AgentHandle` (agent_link.py) is one task: its exit fd is a pipe the link writes to when the agent reports the
  task's end, so the supervisor's one `select` learns of it at once, as of a local task's.
- One thread (`agent_hub.Hub`) reads every link's frames into the tasks' log files and sends the
  heartbeats. A link whose channel ends (the agent or its client died, the connection dropped)
  ends each of its tasks with LOST_EXIT and a line in its log naming the machine.
- Nothing a host sends is trusted (launcher/transports/agent_frames.py reads it): a login
  shell's words before the agent's hello are the host's, shown in its tasks' logs; an unreadable
  frame, a host that never says hello, an agent gone silent, and any failure serving a link (a
  log on a full disk) end that machine's agent alone, named, through the same lost-agent ending
  (no new event kind: the supervisor sees LOST_EXIT and the log's line, as for a cut link).
  The deadlines are `distlaunch.host.timeouts`'s.
"""

from __future__ import annotations

import select
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Protocol, Self

from distlaunch.host.timeouts import AGENT_SILENCE_S, KILL_WAIT_S
from distlaunch.launcher.diagnosis import stacks
from distlaunch.launcher.plan.plan import TaskPlan
from distlaunch.launcher.transports import procs
from distlaunch.launcher.transports.agent_hub import Hub, end_all
from distlaunch.launcher.transports.agent_link import (
    LOST_EXIT,
    AgentCommand,
    AgentHandle,
    AgentLink,
)
from distlaunch.launcher.transports.helper import STOP_MARGIN_S, request_of

# What the backends and tests take from here: the transport, and its link's names.
__all__ = [
    "AGENT_MODULE",
    "LOST_EXIT",
    "AgentCommand",
    "AgentHandle",
    "AgentLink",
    "AgentTransport",
    "StandbyTaker",
    "wait_ended",
]

AGENT_MODULE = "distlaunch.host.agent"
# The longest one probe of a lost machine may take (it runs in a thread of its own).
PROBE_TIMEOUT_S = 10.0


class StandbyTaker(Protocol):
    """The transport's side of its standbys (`agent_standby.AgentStandbys`)."""

    def take(self, task: TaskPlan) -> int | None:
        """The id of the live standby made for exactly ``task`` on its machine's current agent
        (no longer the pool's), or None: a cold start."""


def wait_ended(handles: Sequence[AgentHandle], timeout_s: float) -> list[AgentHandle]:
    """Wait up to ``timeout_s`` (for all together) for the handles' tasks to end; those that
    have not."""
    deadline = time.monotonic() + timeout_s
    pending = [h for h in handles if h.code is None]
    while pending:
        poller = select.poll()
        for handle in pending:
            poller.register(handle.exit_fd, select.POLLIN)
        left = deadline - time.monotonic()
        if left <= 0:
            break
        poller.poll(left * 1000)
        pending = [h for h in pending if h.code is None]
    return pending


class AgentTransport(ABC):
    """Starts tasks through one agent per machine and stops them (where they run: TERM, grace,
    KILL). A subclass says how a machine's agent is started and where a task's stacks are read."""

    def __init__(
        self,
        grace_s: float,
        umask: int | None,
        close_idle: bool = False,
        term_is_notice: bool = False,
    ) -> None:
        self.grace_s = grace_s
        self.umask = umask
        # End a machine's agent once `stop` or `kill` leaves it no task (a job step gives its
        # resources back); else it stays for the machine's next tasks.
        self.close_idle = close_idle
        # SIGTERM to an agent is a stop notice for its tasks, not a stop (a Slurm step's).
        self.term_is_notice = term_is_notice
        self.links: dict[str, AgentLink] = {}
        # The warm standbys, when the run has them (the backend sets them: agent_standby.py).
        self.standbys: StandbyTaker | None = None
        # By machine, the firewall rules its agent holds (`guard`): an agent started again after
        # its machine's was lost holds them again before its tasks start.
        self.guards: dict[str, dict] = {}
        self.clients_started = 0  # how many agents' clients this transport ran (benches)
        self._numbers = 0
        self._hub = Hub()

    @abstractmethod
    def agent_command(self, machine: str) -> AgentCommand:
        """The local client that runs the agent of ``machine``."""

    @abstractmethod
    def stacks(self, handle: AgentHandle, native: bool) -> stacks.Source:
        """The task's program, read where it runs (never its local client)."""

    def request(self, task: TaskPlan) -> dict:
        """What the task's keeper on its machine reads (`distlaunch.host.remote`'s request)."""
        return request_of(task, self.umask, self.grace_s)

    def start(self, task: TaskPlan) -> AgentHandle:
        """Start one task through its machine's agent (started first if the machine has none),
        from the standby made for exactly this plan where there is one."""
        standby = self.standbys.take(task) if self.standbys is not None else None
        link = self.link_of(task.host_name)
        handle = AgentHandle(task, link, self.number(), warm=standby is not None)
        link.add(handle, self.request(task), standby)
        if standby is not None:
            # Whether the standby became the task is the agent's to say (one that died unused is
            # replaced by a cold start there): the supervisor records it as soon as this returns.
            # A restart from a standby is one task's; its round trip is the wait.
            if not handle.started.wait(AGENT_SILENCE_S):
                handle.warm = False
        return handle

    def link_of(self, machine: str) -> AgentLink:
        """The agent of ``machine``: started (and made its guard again, if it was one) unless
        one runs there."""
        link = self.links.get(machine)
        if link is None or link.lost is not None:
            command = self.agent_command(machine)
            link = self.links[machine] = AgentLink(command, self.term_is_notice)
            self.clients_started += 1
            self._hub.add(link)
            if machine in self.guards:
                link.guard(self.guards[machine])
        return link

    def number(self) -> int:
        """A new id on the channels (tasks and standbys alike: a standby's becomes no task's)."""
        self._numbers += 1
        return self._numbers

    def guard(self, requests: Mapping[str, dict], timeout_s: float) -> dict[str, dict | str]:
        """Make each machine's agent (started now, all at once) the guard of the run's firewall
        there (`requests`: `firewall.HostRules.request` by machine), and wait up to ``timeout_s``
        for every answer: the guard's answer line, or why there is none, by machine."""
        self.guards.update(requests)
        links = {machine: self.link_of(machine) for machine in requests}
        deadline = time.monotonic() + timeout_s
        answers: dict[str, dict | str] = {}
        for machine, link in links.items():
            if not link.guard_answered.wait(max(0.0, deadline - time.monotonic())):
                answers[machine] = f"its agent did not answer within {timeout_s:g} s"
            elif link.guard_answer is None:
                answers[machine] = f"its agent did not answer: {link.lost or link.why_lost()}"
            else:
                answers[machine] = link.guard_answer
        return answers

    def stop(self, handles: Sequence[AgentHandle], grace_s: float) -> None:
        """Ask every task's agent to stop it (SIGTERM, ``grace_s``, SIGKILL where it runs), wait
        that long plus a margin for the ends, then `kill` what is left."""
        for handle in handles:
            if handle.code is None:
                handle.link.send("stop", handle.number)
        self.kill(wait_ended(handles, grace_s + STOP_MARGIN_S))

    def kill(self, handles: Sequence[AgentHandle]) -> None:
        """End the tasks now: their keepers SIGKILL them where they run. An agent that does not
        report the ends within KILL_WAIT_S has its client ended, which ends all its tasks."""
        for handle in handles:
            if handle.code is None:
                handle.link.send("kill", handle.number)
        for handle in wait_ended(handles, KILL_WAIT_S):
            procs.kill_groups([handle.link.proc])
            handle.link.end()
        if self.close_idle:
            links = {id(h.link): h.link for h in handles}.values()
            end_all([x for x in links if not x.tasks and not x.standbys and x.lost is None])

    def lost_hosts(self) -> Mapping[str, str]:
        """The machines whose agent was lost, with why (`base.ResizeTransport`): listed until
        a task starts there again (a new agent). An agent this launcher ended itself (EOF on
        its stdin: an idle job step given back, the run's end) is no loss."""
        return {
            machine: f"agent lost: {link.lost}"
            for machine, link in self.links.items()
            if link.lost and not (link.proc.stdin is None or link.proc.stdin.closed)
        }

    def probe(self, host_name: str) -> bool:
        """Whether ``host_name`` answers a fresh connection now (`base.ResizeTransport`); False
        where the backend cannot tell (`probe_argv`: None)."""
        argv = self.probe_argv(host_name)
        if argv is None:
            return False
        try:
            done = subprocess.run(
                argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=PROBE_TIMEOUT_S
            )
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0

    def probe_argv(self, machine: str) -> list[str] | None:
        """The local command that exits 0 when ``machine`` answers (None: the backend has no
        such probe); it must open a connection of its own, never ride on a master connection
        that outlived the machine's loss."""
        return None

    def notify(self, handles: Sequence[AgentHandle]) -> bool:
        """A stop notice to every task (`NoticeTransport`): its keeper sends SIGTERM to the
        task's program alone, where it runs, and goes on watching it."""
        for handle in handles:
            if handle.code is None:
                handle.link.send("notice", handle.number)
        return True

    def close(self) -> None:
        """End every agent (their tasks must be stopped already) and the hub's thread."""
        end_all(list(self.links.values()))
        self._hub.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
