"""Warm standbys on remote machines: the agent of each SSH host or Slurm node keeps one per task of
its machine, so that a restart there skips TensorFlow's import as a local restart does
(launcher/transports/local/standby.py has the design; the rules are the same, and which standbys
to keep, discard and start is one decision for both: launcher/transports/standby_rule.py).

A standby is the task's next attempt started early by the machine's agent
(`distlaunch.host.agent`'s ``prepare``): the task's own bootstrap command (a PSS server's through
the bootstrap too), under a keeper like any task there (its own process group and session,
pinned to the task's CPUs, killed with its group when its keeper's stdin closes: it dies with its
agent, so with the launcher or the link), with that attempt's env and DISTLAUNCH_STANDBY, whose
env writes the launcher reads from the program's source (`program_scan.standby_env`) as for a
local standby. Its output is held by the agent, never written to a log, until it becomes a task.

`prepare` (the supervisor, once settled) has the agents start the standbys of the next attempt
and discard stale ones; `take` (the transport's `start`) hands the standby made for exactly that
plan to its agent's ``start``: the agent sends its held output as the task's and says go. A
standby that died (its end reported) is not taken; one that dies between `take` and the agent's
``start`` is replaced by a cold start there. A machine whose agent was lost has no standby left:
its tasks restart cold, and the next `prepare` makes new ones on its new agent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from distlaunch.host import bootstrap
from distlaunch.host.timeouts import KILL_WAIT_S
from distlaunch.launcher.core.backends import TaskTransport
from distlaunch.launcher.plan import program_scan
from distlaunch.launcher.plan.plan import BOOTSTRAP_MODULE, TaskPlan
from distlaunch.launcher.plan.program_env import StandbyEnv
from distlaunch.launcher.plan.program_scan import SERVE_MODULE
from distlaunch.launcher.transports import procs
from distlaunch.launcher.transports.agent import AgentLink, AgentTransport
from distlaunch.launcher.transports.base import StandbyPool
from distlaunch.launcher.transports.standby_rule import ReconciledPool


def standby_command(task: TaskPlan) -> tuple[tuple[str, ...], StandbyEnv] | None:
    """The command of a remote standby for ``task`` and the env writes its bootstrap makes before
    its imports; None for a task no standby can stand in for (not a bootstrap or server command,
    or a program whose writes cannot be repeated)."""
    python, *rest = task.argv
    if rest[:1] == [bootstrap.__file__] or rest[:2] == ["-m", BOOTSTRAP_MODULE]:
        program = rest[1:] if rest[0] == bootstrap.__file__ else rest[2:]
        argv, env = tuple(task.argv), program_scan.standby_env(program, task.cwd)
    elif rest[:2] == ["-m", SERVE_MODULE]:
        # Through the bootstrap, run as the task's own kind of command would run it there.
        boot = (
            [bootstrap.__file__] if task.transport.sees_launcher_files else ["-m", BOOTSTRAP_MODULE]
        )
        argv, env = (python, *boot, *rest), StandbyEnv()
    else:
        return None
    return None if env.cold else (argv, env)


@dataclass
class _Standby:
    """One standby as its agent reports it (frames arrive on the hub's thread)."""

    task: TaskPlan  # the attempt it was made for
    link: AgentLink
    number: int  # its id on the channel
    pid: int | None = None  # its keeper's, on the machine
    ready: bool = False
    ended: threading.Event = field(default_factory=threading.Event)

    def frame(self, kind: bytes, payload: bytes) -> None:
        """``s`` its keeper's pid, ``r`` ready, ``x`` it ended (died, or was discarded)."""
        if kind == b"s":
            self.pid = int(payload)
        elif kind == b"r":
            self.ready = True
        elif kind == b"x":
            self.ended.set()

    def alive(self) -> bool:
        return not self.ended.is_set() and self.link.lost is None


class AgentStandbys(ReconciledPool["_Standby"]):
    """The standbys of the tasks an agent transport runs (a `transports.base.StandbyPool`, and
    the transport's `StandbyTaker`); ``kind``: the tasks of the plan it runs."""

    def __init__(self, transport: AgentTransport, kind: TaskTransport) -> None:
        super().__init__()
        self.transport = transport
        self.kind = kind
        transport.standbys = self

    def take(self, task: TaskPlan) -> int | None:
        """The id of the standby made for exactly ``task``, alive on its machine's current agent
        (it is the caller's to start from now), or None: the task starts cold."""
        standby = self._standbys.pop(task.name, None)
        if standby is None:
            return None
        current = self.transport.links.get(task.host_name)
        if standby.task != task or not standby.alive() or standby.link is not current:
            self._discard(standby)
            return None
        with standby.link.lock:
            standby.link.standbys.pop(standby.number, None)
        return standby.number

    def poll(self) -> None:
        """Nothing to do: the agents report readiness and ends as they happen."""

    def record(self) -> dict:
        """run.json's ``standbys``: per task, the host, its keeper's pid there, the attempt it was
        made for, whether it has imported TensorFlow and the CPUs it is pinned to."""
        return {
            name: {
                "host": s.task.host_name,
                "pid": s.pid,
                "attempt": s.task.attempt,
                "ready": s.ready,
                "cpus": list(s.task.cpus.ids),
            }
            for name, s in self._standbys.items()
        }

    def close(self) -> None:
        """Have every standby killed; return once their agents say they are gone (or KILL_WAIT_S
        has passed: then their agents' clients are ended, which ends them too). A transport that
        ends idle agents (Slurm's steps) ends those left with no task."""
        standbys = list(self._standbys.values())
        self._standbys.clear()
        for standby in standbys:
            self._discard(standby)
        deadline = time.monotonic() + KILL_WAIT_S
        for standby in standbys:
            # A lost agent says nothing more: its standbys went with it.
            while not standby.ended.wait(0.05) and standby.link.lost is None:
                if time.monotonic() > deadline:
                    procs.kill_groups([standby.link.proc])
                    standby.link.end()
        if self.transport.close_idle:
            for link in self.transport.links.values():
                if not link.tasks and not link.standbys and link.lost is None:
                    link.close()

    def _make(self, task: TaskPlan) -> _Standby | None:
        """Have the task's machine's agent start a standby for it (`prepare`), unless its
        command is one no standby can stand in for."""
        command = standby_command(task)
        if command is None:
            return None
        argv, env = command
        link = self.transport.link_of(task.host_name)
        standby = _Standby(task, link, self.transport.number())
        with link.lock:
            link.standbys[standby.number] = standby
        request = {**self.transport.request(task), "argv": list(argv)}
        writes = [w.to_json() for w in env.writes]
        link.send("prepare", standby.number, request=request, writes=writes)
        return standby

    def _discard(self, standby: _Standby) -> None:
        standby.link.send("discard", standby.number)


class JointStandbys:
    """Several transports' standbys as one `StandbyPool` (a run of local tasks and SSH hosts)."""

    def __init__(self, *pools: StandbyPool) -> None:
        self.pools = pools

    def prepare(self, tasks: Sequence[TaskPlan]) -> None:
        """Each pool has the standbys of its own tasks among ``tasks``."""
        for pool in self.pools:
            pool.prepare(tasks)

    def poll(self) -> None:
        """Each pool notes which of its standbys are ready."""
        for pool in self.pools:
            pool.poll()

    def record(self) -> dict:
        """run.json's ``standbys`` of every pool (tasks have one name across pools)."""
        return {name: entry for pool in self.pools for name, entry in pool.record().items()}

    def close(self) -> None:
        """Kill every pool's standbys."""
        for pool in self.pools:
            pool.close()
