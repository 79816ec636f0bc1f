"""The `local` backend: tasks on this machine (local processes) and on SSH hosts, in one run.

`HostRouter` is one transport over two: each task goes to the transport of its host.
`LocalBackend.open` is the backend's `up`: the SSH session and preflight first (which picks the
remote tasks' `auto` ports, so it comes before the plan), then the plan, then the network
sandbox and both transports. Its run.json section (`SshHosts`) keeps the SSH hosts as resolved.

A run with every task on this machine (`LocalLaunch`) imports nothing of SSH, preflight or the
firewall: the launcher's start is part of every local run's time (bench/log_fanin.py).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from distlaunch.launcher.core.backends import TaskTransport
from distlaunch.launcher.core.console import Console
from distlaunch.launcher.network import netns
from distlaunch.launcher.plan import placement, ports
from distlaunch.launcher.plan.cpu_fit import Topology
from distlaunch.launcher.plan.plan import Plan, TaskPlan, make_plan
from distlaunch.launcher.record import rundir
from distlaunch.launcher.record.state import RunRecord, TaskRecord
from distlaunch.launcher.spec.model import Host, LoadedSpec
from distlaunch.launcher.transports.base import (
    Opened,
    StandbyPool,
    TaskHandle,
    TaskStacks,
    Transport,
    UpOptions,
)
from distlaunch.launcher.transports.local import cpus, gpus
from distlaunch.launcher.transports.local.transport import LocalTransport, recorded_task_stacks

if TYPE_CHECKING:  # annotations; what SSH hosts need is imported where a run has them
    from distlaunch.launcher.diagnosis.stacks import Source
    from distlaunch.launcher.network.firewall import Protection
    from distlaunch.launcher.plan.isolation import Capabilities
    from distlaunch.launcher.transports.ssh.preflight import HostReport
    from distlaunch.launcher.transports.ssh.transport import Session, SshTransport

ISOLATED_NOTE = (
    "isolated: tasks run in a private network namespace (loopback only: their ports cannot be "
    "reached from outside the run, and they cannot reach the network; "
    '"isolation": "off" turns it off)'
)
EXPOSURE_NOTE = (
    "note: ports {ports} can be reached from other machines: TensorFlow's gRPC servers listen on "
    "every interface with no authentication, and {reason}. To prevent it, {remedy} "
    "(see docs/security.md)"
)


class HostRouter:
    """Starts local tasks with ``local`` and SSH tasks with ``ssh``; stops both at once."""

    def __init__(self, local: LocalTransport, ssh: Transport | None) -> None:
        self.local = local
        self.ssh = ssh

    def start(self, task: TaskPlan) -> TaskHandle:
        """Start ``task`` with the transport of its host."""
        return self._for(task).start(task)

    def stop(self, handles: Sequence[TaskHandle], grace_s: float) -> None:
        """Stop every handle with its own transport, the transports side by side, so that the
        grace periods overlap instead of adding up."""
        groups = self._grouped(handles)
        threads = [
            threading.Thread(target=transport.stop, args=(group, grace_s), name="stop")
            for transport, group in groups[1:]
        ]
        for thread in threads:
            thread.start()
        if groups:
            transport, group = groups[0]
            transport.stop(group, grace_s)
        for thread in threads:
            thread.join()

    def notify(self, handles: Sequence[TaskHandle]) -> bool:
        """Send the tasks a stop notice, each through its own transport (local: taskinit's
        NOTICE; SSH: the helper's ``notice``); False, and nothing sent, where a transport has no
        notice."""
        groups = self._grouped(handles)
        sends = [getattr(transport, "notify", None) for transport, _ in groups]
        if any(send is None for send in sends):
            return False
        return all([send(group) for send, (_, group) in zip(sends, groups, strict=True)])

    def kill(self, handles: Sequence[TaskHandle]) -> None:
        """Kill every handle with its own transport."""
        for handle in handles:
            self._for(handle.task).kill([handle])

    def stacks(self, handle: TaskHandle, native: bool) -> Source:
        """Where the task's stacks are read, as its own transport says."""
        return self._for(handle.task).stacks(handle, native)

    def lost_hosts(self) -> Mapping[str, str]:
        """The SSH hosts whose agent was lost (`base.ResizeTransport`); this machine is never
        lost."""
        lost = getattr(self.ssh, "lost_hosts", None)
        return lost() if lost is not None else {}

    def probe(self, host_name: str) -> bool:
        """Whether SSH host ``host_name`` answers a fresh connection (`base.ResizeTransport`)."""
        probe = getattr(self.ssh, "probe", None)
        return bool(probe(host_name)) if probe is not None else False

    def _grouped(self, handles: Sequence[TaskHandle]) -> list[tuple[Transport, list[TaskHandle]]]:
        """The handles by the transport of their hosts."""
        groups: dict[int, tuple[Transport, list[TaskHandle]]] = {}
        for handle in handles:
            transport = self._for(handle.task)
            groups.setdefault(id(transport), (transport, []))[1].append(handle)
        return list(groups.values())

    def _for(self, task: TaskPlan) -> Transport:
        if task.transport != TaskTransport.SSH:
            return self.local
        if self.ssh is None:
            raise ValueError(
                f"{task.name} runs on SSH host {task.host_name!r} but the run has no SSH transport"
            )
        return self.ssh


def plan(
    loaded: LoadedSpec,
    run_id: str,
    run_dir: Path,
    attempt: int,
    remote_ports: dict[ports.TaskKey, int] | None = None,
    here: bool = True,
    remote_cpus: Mapping[str, Topology] | None = None,
    find_caps: Callable[[], Capabilities] | None = None,
) -> Plan:
    """Place the tasks, decide the isolation, allocate ports and build the plan of this attempt
    (nothing started).

    ``remote_ports`` are the SSH tasks' ports as preflight checked or picked them on their hosts;
    ``remote_cpus`` what each SSH machine (by address) gives the run, as its probe reported (a
    dry run has none: the SSH tasks' `auto` CPUs are left to `up`). The local tasks split this
    machine's CPUs (SpecError when their `cpus` do not fit it).
    ``here``: the plan is to be started on this machine, so its local tasks' GPUs must exist
    (SpecError otherwise); `plan`'s dry run may be written for another machine.
    ``find_caps``: how this machine's isolation capabilities are found (netns.decide).
    """
    placed = placement.on_hosts(loaded)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if here:
        gpus.check(loaded, placed, visible)
    topos: dict[str, Topology | None] = dict(remote_cpus or {})
    topos[placement.THIS_MACHINE] = cpus.this_machine(visible)
    placed = placement.with_cpus(loaded, placed, topos)
    isolation = netns.decide(loaded, placed, find_caps)
    picked = ports.allocate(loaded, placed, private=isolation.private, remote=remote_ports)
    return make_plan(
        loaded,
        placed.with_ports(picked),
        run_id,
        run_dir,
        attempt,
        visible,
        isolation=isolation,
    )


class LocalLaunch:
    """One `up` of the local backend with every task on this machine (see the module docstring)."""

    def __init__(self, loaded: LoadedSpec) -> None:
        self.loaded = loaded
        self._held: netns.Sandbox | None = None  # the run's holder, made by `plan` for `open`

    def plan(self, run_id: str, run_dir: Path, attempt: int) -> Plan:
        """The plan (`plan` above): no host to check first. This machine is probed by starting
        the run's own namespace holder (netns.hold_or_probe), which `open` then uses."""

        def find_caps() -> Capabilities:
            self.close()
            self._held, caps = netns.hold_or_probe(run_id)
            return caps

        return plan(self.loaded, run_id, run_dir, attempt, find_caps=find_caps)

    @contextmanager
    def open(self, plan: Plan) -> Iterator[Opened]:
        """The sandbox (when isolated) and the local transport; the sandbox closes only after
        the supervisor has stopped every task in it."""
        held, self._held = self._held, None
        with netns.sandbox(plan.isolation, plan.run_id, held) as sandbox:
            local = LocalTransport(sandbox, standby=plan.standby)
            note = network_note(plan)
            yield Opened(
                HostRouter(local, None),
                _sandbox_record(sandbox),
                None,
                (note,) if note else (),
                None,
                standbys=local.standbys,
            )

    def close(self) -> None:
        """End the holder `plan` made if no `open` took it (the start stopped in between)."""
        if self._held is not None:
            self._held.close()
            self._held = None


def _sandbox_record(sandbox: netns.Sandbox | None) -> dict:
    """What run.json keeps of the run's sandbox (its holder, for `down` after a dead launcher)."""
    return {} if sandbox is None else {"netns_holder_pid": sandbox.pid}


class HostsLaunch:
    """One `up` of the local backend with tasks on SSH hosts (see the module docstring)."""

    def __init__(self, loaded: LoadedSpec, session: Session, console: Console) -> None:
        self.loaded = loaded
        self.session = session
        self.console = console
        private = loaded.spec.permissions == "private"
        self.umask = rundir.PRIVATE_UMASK if private else None
        self.reports: list[HostReport] = []

    def plan(self, run_id: str, run_dir: Path, attempt: int) -> Plan:
        """Check the SSH hosts (HostError when one is not usable), then plan with their ports."""
        from distlaunch.launcher.transports.ssh import preflight

        self.reports = preflight.check(self.loaded, self.session, self.umask)
        for report in self.reports:
            self.console.say(f"host {self.session.target(report.name)}: {report.summary()}")
        picked = preflight.picked_ports(self.reports)
        remote_cpus = preflight.cpus_of(self.loaded, self.reports)
        return plan(self.loaded, run_id, run_dir, attempt, picked, remote_cpus=remote_cpus)

    @contextmanager
    def open(self, plan: Plan) -> Iterator[Opened]:
        """The SSH transport, whose hosts' agents start first as their firewall guards, the
        sandbox (when isolated) and the local transport. The firewall is up before any task
        starts and goes after every task has stopped (with the agents); the sandbox closes only
        after the supervisor has stopped every task in it."""
        from distlaunch.launcher.transports.ssh import transport as ssh

        grace_s = self.loaded.spec.timeouts.grace_s
        with ssh.SshTransport(self.session, grace_s, self.umask, plan.run_id) as remote:
            protection = self._protect(plan, remote)
            with netns.sandbox(plan.isolation, plan.run_id) as sandbox:
                record = _sandbox_record(sandbox)
                notes = [note for note in (network_note(plan), *protection.notes()) if note]
                section = None
                if self.reports:
                    section = SshHosts.of(self.loaded, [r.name for r in self.reports])
                    record["network"] = protection.to_json()
                    if not self.loaded.spec.shared_dir_is_shared:
                        notes.append(
                            "SSH hosts keep their run files on their own disks; "
                            f"`distlaunch collect {plan.run_id}` copies them here"
                        )
                shown = HostConsole(self.console, plan) if self.reports else None
                local = LocalTransport(sandbox, standby=plan.standby)
                standbys: StandbyPool | None = local.standbys
                if local.standbys is not None:
                    from distlaunch.launcher.transports import agent_standby

                    hosts = agent_standby.AgentStandbys(remote, TaskTransport.SSH)
                    standbys = agent_standby.JointStandbys(local.standbys, hosts)
                yield Opened(
                    HostRouter(local, remote),
                    record,
                    section,
                    tuple(notes),
                    shown,
                    standbys=standbys,
                )

    def _protect(self, plan: Plan, remote: SshTransport) -> Protection:
        """The firewall of the run's SSH hosts: each host's agent, started now, is its guard
        (the rules go when the agent ends, after its tasks: `remote` closes last)."""
        from distlaunch.launcher.network import firewall
        from distlaunch.launcher.transports.ssh import transport as ssh

        rules = firewall.run_rules(plan, ssh.jumped_hosts(self.session.hosts))
        mode = self.loaded.spec.network.protect
        return firewall.protect_by_agents(mode, plan.run_id, rules, remote.guard)


@dataclass(frozen=True)
class SshHosts:
    """The local backend's run.json section: its SSH hosts as resolved (for `collect` and
    `stacks`), and whether they share the run dir."""

    shared_dir_is_shared: bool
    hosts: Mapping[str, Host]

    @classmethod
    def of(cls, loaded: LoadedSpec, names: Sequence[str]) -> SshHosts:
        """The SSH hosts ``names`` of ``loaded``."""
        return cls(loaded.spec.shared_dir_is_shared, {n: loaded.hosts[n] for n in names})

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SshHosts:
        """Read the section (a record without the key: shared, as the hosts were before it)."""
        hosts = data.get("hosts") or {}
        return cls(
            bool(data.get("shared_dir_is_shared", True)),
            {name: Host.model_validate(host) for name, host in hosts.items()},
        )

    def to_json(self) -> dict[str, Any]:
        """The section as JSON data."""
        return {
            "shared_dir_is_shared": self.shared_dir_is_shared,
            "hosts": {name: host.model_dump(mode="json") for name, host in self.hosts.items()},
        }


class LocalBackend:
    """The `local` backend (a `transports.base.Backend`): processes here and on SSH hosts."""

    name: ClassVar[str] = "local"
    title: ClassVar[str] = "local"

    def plan(self, loaded: LoadedSpec, run_id: str, run_dir: Path, attempt: int) -> Plan:
        """A dry run's plan (`plan` above, with the SSH tasks' ports as the spec gives them and
        no check of this machine's GPUs)."""
        return plan(loaded, run_id, run_dir, attempt, here=False)

    @contextmanager
    def open(
        self, loaded: LoadedSpec, console: Console, options: UpOptions
    ) -> Iterator[LocalLaunch | HostsLaunch]:
        """One `up` (``options`` do not apply here); the SSH master connections close last."""
        remote = {n: h for n, h in loaded.hosts.items() if h.transport == TaskTransport.SSH}
        if not remote:
            launch = LocalLaunch(loaded)
            try:
                yield launch
            finally:
                launch.close()
            return
        from distlaunch.launcher.transports.ssh import transport as ssh

        with ssh.Session(remote) as session:
            yield HostsLaunch(loaded, session, console)

    @contextmanager
    def cleanup(self, record: RunRecord, run_dir: Path, grace_s: float) -> Iterator[list[str]]:
        """Nothing: `down`'s sweep here reaches every process of a local run (an SSH task ends
        with its local ssh client: the remote helper stops the task when its stdin closes)."""
        yield []

    @contextmanager
    def stacks(self, record: RunRecord, run_dir: Path) -> Iterator[TaskStacks]:
        """Local tasks by py-spy here, SSH tasks by the remote helper over one SSH session."""
        from distlaunch.launcher.transports.ssh import transport as ssh

        section = self.section(record)
        with ssh.Session(dict(section.hosts) if section else {}) as session:

            def read(plan: dict, entry: TaskRecord, native: bool) -> Source:
                if plan.get("transport") == TaskTransport.SSH:
                    name = plan.get("name", "")
                    return ssh.task_stacks(session, plan["host_name"], record.run_id, name, native)
                return recorded_task_stacks(run_dir, entry, native)

            yield read

    def section(self, record: RunRecord) -> SshHosts | None:
        """The SSH hosts ``record`` keeps (None: a run of another backend, or without SSH hosts)."""
        if record.backend != self.name or record.section is None:
            return None
        return SshHosts.from_json(record.section)


class HostConsole(Console):
    """``console`` with each task's host in its line prefix (``worker-0@node1 | ``), for runs on
    several hosts."""

    def __init__(self, console: Console, plan: Plan) -> None:
        super().__init__(console.out, console.err, console.color, console.quiet_tf)
        self.hosts = {t.name: t.host_name for t in plan.tasks}
        self.extra = max(len(h) + 1 for h in self.hosts.values())

    def prefix(self, name: str, number: int, width: int) -> bytes:
        """The base prefix of ``name@host``, widened by the longest ``@host``."""
        return super().prefix(f"{name}@{self.hosts[name]}", number, width + self.extra)


def network_note(plan: Plan) -> str | None:
    """The line `up` prints about who can reach the local tasks' ports (the firewall's notes
    speak for the SSH hosts')."""
    if plan.isolation.private:
        return ISOLATED_NOTE
    listed = ", ".join(str(t.port) for t in plan.tasks if t.transport == TaskTransport.LOCAL)
    if not listed:
        return None
    return EXPOSURE_NOTE.format(
        ports=listed, reason=plan.isolation.reason, remedy=plan.isolation.remedy
    )
