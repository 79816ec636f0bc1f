"""The per-run firewall of remote hosts: which rules each host gets, and the guards that hold them.

TensorFlow's gRPC ports take work from anyone who reaches them. A local run hides them in a
private network namespace (netns.py), a compose run on an internal network; a run across hosts
must keep them open to its peers, so each remote host gets a firewall for the run's lifetime: its
task ports admit the run's own hosts and loopback only (`plan_rules`, pure, what `plan` shows).

The host owns its rules, not the launcher: the host's agent (`distlaunch.host.agent`, over SSH
or as a Slurm node's job step) is its guard (`protect_by_agents`). It takes the request over its
channel, installs one nftables table (an iptables chain where nft is missing; the code is
`distlaunch.host.guard`'s) and deletes it when it ends: its stdin closes, its heartbeats stop or
it is signalled. So the rules go with the run however it ends: an orderly teardown closes the
agents after the tasks have stopped; a launcher that is SIGKILLed, or a connection that drops,
closes their stdin too. A host runs one distlaunch process for the run, not an agent and a guard.

The rules of one run on one host have a name of their own (`rules_name`: the run id and a digest
of the run id, the run dir's path and the host): runs that share an id (``nightly`` in two shared
dirs) or whose ids differ only in characters nft cannot take (``run-1``, ``run.1``) never share a
table, so no run's guard replaces or deletes another run's rules. run.json keeps the names, for
`distlaunch down`.

The launcher checks that tasks joined by connecting to their ports, so every guard admits the
launcher's own addresses (`run_rules`: the source addresses of its routes to the hosts). Over SSH
the guard also admits the address the session comes from (SSH_CONNECTION: the launcher's, also
through NAT), except for a host reached through a jump host (ProxyJump or ProxyCommand), where
that address is the jump host's.

Changing a host's firewall needs root or CAP_NET_ADMIN there. Where a guard cannot, the spec's
``network.protect`` decides: ``auto`` goes on and says which ports stay open, ``required`` stops
before any task starts (HostError, exit 2), ``off`` starts no guard.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import socket
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from distlaunch.host import guard
from distlaunch.host.timeouts import ANSWER_TIMEOUT_S, HEARTBEAT_TIMEOUT_S
from distlaunch.launcher.core.backends import TaskTransport
from distlaunch.launcher.core.errors import HostError
from distlaunch.launcher.plan.plan import Plan

GUARD_MODULE = "distlaunch.host.guard"
AUTO, OFF, REQUIRED = "auto", "off", "required"
# How long a closed guard may take to remove its table (it first waits for the ports to close).
CLOSE_TIMEOUT_S = guard.LINGER_S + 10.0


def rules_name(run_id: str, run_dir: str, host: str) -> str:
    """The name of run ``run_id``'s rules on ``host`` (table ``inet distlaunch_<name>``): the run
    id in letters, digits and ``_``, then a digest of the exact run id, the run dir's real path
    and the host. Unique per run and host; a resumed run (the same dir) gets its own name again."""
    identity = "\0".join((run_id, os.path.realpath(run_dir), host))
    digest = hashlib.sha256(identity.encode()).hexdigest()[:12]
    return f"{re.sub(r'[^A-Za-z0-9_]', '_', run_id)}_{digest}"


@dataclass(frozen=True)
class HostRules:
    """What one host's guard must do: ports of the run's tasks there admit ``allow`` only."""

    host: str  # the host's name in the spec
    name: str  # the rules' name on the host (`rules_name`)
    ports: tuple[int, ...]
    allow: tuple[str, ...]  # addresses (or names the host resolves) of every host of the run
    launcher: tuple[str, ...] = ()  # the launcher's addresses, for its join checks
    ssh_client: bool = True  # also admit the address the guard's SSH session comes from
    jump_host: bool = False  # the SSH session comes through a jump host (not admitted)

    def request(self, run_id: str) -> dict:
        """The JSON request the guard reads on its stdin."""
        return {
            "run_id": run_id,
            "name": self.name,
            "ports": list(self.ports),
            "allow": sorted(set(self.allow) | set(self.launcher)),
            "allow_client": self.ssh_client,
            "heartbeat_s": HEARTBEAT_TIMEOUT_S,
        }

    def describe(self) -> str:
        """The rules in one line, as `plan` prints them."""
        ports = ", ".join(str(p) for p in self.ports)
        admitted = [", ".join(self.allow)]
        if self.launcher:
            admitted.append(f"the launcher ({', '.join(self.launcher)})")
        if self.ssh_client:
            admitted.append("the address the launcher's SSH session comes from")
        jump = "; the jump host is not admitted" if self.jump_host else ""
        return (
            f"{self.host}: nftables table inet {guard.table_name(self.name)}: tcp ports {ports} "
            f"admit {', '.join(admitted)} and loopback{jump}; drop all others "
            f"(iptables chain {guard.chain_name(self.name)} where nft is missing)"
        )


# The transports whose hosts get a guard (`TaskTransport.guarded`); local tasks run on this
# machine (see isolation).
REMOTE = tuple(t for t in TaskTransport if t.guarded)


def plan_rules(
    plan: Plan,
    remote: Collection[str] = REMOTE,
    launcher: Collection[str] = (),
    jumped: Collection[str] = (),
) -> dict[str, HostRules]:
    """The rules of every host whose tasks run over a ``remote`` transport (pure).

    Every host of the run may reach every task port: TensorFlow's tasks dial each other (MWMS
    all-reduce, PSS workers to ps), and an evaluator or a local task is a peer like any other.
    ``launcher`` adds the launcher's addresses (its join checks); SSH hosts in ``jumped`` are
    reached through a jump host, whose address (the SSH session's) is not admitted.
    """
    allow = tuple(sorted({t.host for t in plan.tasks}))
    ports: dict[str, set[int]] = {}
    over_ssh: dict[str, bool] = {}
    for task in plan.tasks:
        if task.transport in remote:
            ports.setdefault(task.host_name, set()).add(task.port)
            over_ssh[task.host_name] = task.transport == TaskTransport.SSH
    return {
        host: HostRules(
            host,
            rules_name(plan.run_id, plan.run_dir, host),
            tuple(sorted(p)),
            allow,
            tuple(sorted(launcher)),
            ssh_client=over_ssh[host] and host not in jumped,
            jump_host=over_ssh[host] and host in jumped,
        )
        for host, p in sorted(ports.items())
    }


def run_rules(plan: Plan, jumped: Collection[str] = ()) -> dict[str, HostRules]:
    """`plan_rules` of a run, with the launcher's addresses admitted on every remote host.

    The launcher connects to every task port (the join check) from the address its route to the
    host leaves from. A Slurm node's guard cannot tell where that is, nor can an SSH host's guard
    behind a jump host (its session comes from the jump host), so the launcher names it.
    """
    hosts = sorted({t.host for t in plan.tasks if t.transport in REMOTE})
    return plan_rules(plan, launcher=launcher_addresses(hosts), jumped=jumped)


def launcher_addresses(hosts: Collection[str]) -> list[str]:
    """The source addresses this machine's connections to ``hosts`` leave from (no packet sent:
    a UDP socket's connect only asks the kernel's routing). Loopback is left out (always admitted);
    a host that does not resolve or route is skipped: the launcher cannot reach its tasks either."""
    found: set[str] = set()
    for host in hosts:
        try:
            infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
        except OSError:
            continue
        for family, kind, proto, _, address in infos:
            try:
                with socket.socket(family, kind, proto) as probe:
                    probe.connect(address)
                    source = ipaddress.ip_address(probe.getsockname()[0].split("%")[0])
            except (OSError, ValueError):
                continue
            if not source.is_loopback:
                found.add(str(source))
    return sorted(found)


def plan_json(mode: str, rules: Mapping[str, HostRules]) -> dict:
    """The firewall part of `plan --json`: the mode and each host's rules."""
    hosts = {}
    if mode != OFF:
        hosts = {
            name: {
                "table": guard.table_name(r.name),
                "ports": list(r.ports),
                "allow": list(r.allow),
                "launcher": list(r.launcher),
                "ssh_client": r.ssh_client,
            }
            for name, r in rules.items()
        }
    return {"protect": mode, "hosts": hosts}


@dataclass(frozen=True)
class HostState:
    """Whether a host's task ports are firewalled for this run, and how or why not."""

    host: str
    ports: tuple[int, ...]
    protected: bool
    why: str = ""  # why not, when not protected
    name: str = ""  # the rules' name on the host (`rules_name`), for `down`
    how: str = "nftables"  # or "iptables", where nft is missing
    table: str = ""  # the nftables table, or the iptables chain
    allowed: tuple[str, ...] = ()  # the addresses the guard admits, as the host resolved them

    @property
    def rules(self) -> str:
        """Where the host's rules are, e.g. ``nftables table inet distlaunch_...``."""
        kind = "iptables chain" if self.how == "iptables" else "nftables table inet"
        return f"{kind} {self.table}"

    def to_json(self) -> dict:
        """The host's entry in run.json's ``network.hosts``."""
        data: dict = {"protected": self.protected, "ports": list(self.ports)}
        if self.name:
            data["name"] = self.name
        if self.protected:
            data.update(how=self.how, table=self.table, allowed=list(self.allowed))
        else:
            data["why"] = self.why
        return data


@dataclass(frozen=True)
class Protection:
    """The firewall of one run: the spec's mode and the state of each remote host."""

    mode: str
    hosts: tuple[HostState, ...] = field(default_factory=tuple)

    def open_hosts(self) -> list[HostState]:
        """The hosts whose task ports anyone who reaches them can connect to."""
        return [h for h in self.hosts if not h.protected]

    def to_json(self) -> dict:
        """What run.json keeps under ``network`` (`status` reads it)."""
        return {
            "protect": self.mode,
            "hosts": {h.host: h.to_json() for h in self.hosts},
        }

    def notes(self) -> list[str]:
        """The lines `up` prints: who can reach the remote task ports, and what to do about it."""
        lines = []
        guarded = [h for h in self.hosts if h.protected]
        if guarded:
            lines.append(
                f"firewall: on {', '.join(h.host for h in guarded)} the run's task ports admit only the "
                f"run's hosts and loopback ({', '.join(sorted({h.rules for h in guarded}))}, removed when "
                "the run ends)"
            )
        if self.mode == OFF and self.hosts:
            lines.append(
                f'note: "network": {{"protect": "off"}}: {_open_ports(self.hosts)} stay open to anyone who '
                "reaches those hosts: TensorFlow's gRPC servers have no authentication (see docs/security.md)"
            )
            return lines
        for host in self.open_hosts():
            lines.append(
                f"note: ports {', '.join(str(p) for p in host.ports)} stay open to anyone who reaches "
                f"{host.host}: {host.why}. "
                'Give the user the tasks run as root or CAP_NET_ADMIN there, or set "network": {"protect": "required"} '
                "to refuse such runs (see docs/security.md)"
            )
        return lines


def _open_ports(hosts: Sequence[HostState]) -> str:
    return "; ".join(f"ports {', '.join(str(p) for p in h.ports)} on {h.host}" for h in hosts)


def status_lines(network: Mapping | None, running: bool) -> list[str]:
    """`status`'s lines on the firewall of a run from its run.json ``network`` entry."""
    if not network or not network.get("hosts"):
        return []
    if network.get("protect") == OFF:
        return [
            f'firewall: off ("network": {{"protect": "off"}}); {_open_ports(_states(network))} open'
        ]
    lines = []
    for state in _states(network):
        ports = ", ".join(str(p) for p in state.ports)
        if not state.protected:
            lines.append(f"firewall: {state.host} OPEN (ports {ports}): {state.why}")
        elif running:
            lines.append(f"firewall: {state.host} protected (ports {ports}, {state.rules})")
        else:
            lines.append(
                f"firewall: {state.host} was protected while the run ran (ports {ports}; rules removed)"
            )
    return lines


def _states(network: Mapping) -> list[HostState]:
    return [
        HostState(
            name,
            tuple(h.get("ports", ())),
            bool(h.get("protected")),
            h.get("why", ""),
            name=h.get("name", ""),
            how=h.get("how", "nftables"),
            table=h.get("table", ""),
        )
        for name, h in network["hosts"].items()
    ]


def protect_by_agents(
    mode: str,
    run_id: str,
    rules: Mapping[str, HostRules],
    guard: Callable[[Mapping[str, dict], float], Mapping[str, dict | str]],
) -> Protection:
    """Firewall every host of ``rules`` through the host's agent, which holds the rules until it
    ends (`distlaunch.host.agent`'s ``guard``): one process per host, not an agent and a guard.

    ``guard(requests, timeout_s)`` makes each host's agent its guard (`HostRules.request` by
    host) and gives each one's answer, or why there is none. Raise HostError when ``mode`` is
    ``required`` and a host cannot be firewalled (the caller then ends the agents).
    """
    if mode == OFF or not rules:
        return _off(mode, rules)
    # ``required``: an agent that cannot install its host's rules starts nothing there (a
    # restarted one too, which is not waited for here: its link ends, naming why).
    requests = {
        name: {**r.request(run_id), "required": mode == REQUIRED} for name, r in rules.items()
    }
    answers = guard(requests, ANSWER_TIMEOUT_S)
    states = []
    for name, r in rules.items():
        answer = answers.get(name, "its agent gave no answer")
        if isinstance(answer, str):
            states.append(HostState(name, r.ports, False, answer, r.name))
        else:
            states.append(host_state(r, answer, "its agent gave no reason"))
    return _required(Protection(mode, tuple(states)))


def _off(mode: str, rules: Mapping[str, HostRules]) -> Protection:
    return Protection(
        mode,
        tuple(
            HostState(r.host, r.ports, False, "protection is off", r.name) for r in rules.values()
        ),
    )


def _required(protection: Protection) -> Protection:
    """``protection``, unless its mode is ``required`` and a host is open: HostError then."""
    if protection.mode == REQUIRED and protection.open_hosts():
        why = "; ".join(f"{h.host}: {h.why}" for h in protection.open_hosts())
        raise HostError(
            f'"network": {{"protect": "required"}}, but not every host can be firewalled ({why}); '
            "nothing was started",
            [],
        )
    return protection


def host_state(rules: HostRules, answer: dict, why_none: str) -> HostState:
    """A host's state from its guard's ``answer`` line (an empty dict: none came, ``why_none``)."""
    if answer.get("protected"):
        return HostState(
            rules.host,
            rules.ports,
            True,
            name=rules.name,
            how=str(answer.get("how", "nftables")),
            table=str(answer.get("table", "")),
            allowed=tuple(answer.get("allowed", ())),
        )
    why = str(answer.get("why", "the guard gave no reason")) if answer else why_none
    return HostState(rules.host, rules.ports, False, why, rules.name)
