"""Preflight: before anything starts, check every remote machine at once and pick its `auto` ports there.

Each machine (an SSH host, a Slurm node) runs `ssh_probe.py` with its own Python, all in
parallel: it is reachable, its Python imports distlaunch at this launcher's protocol and finds
TensorFlow, it sees the shared dir (or can write its own copy), the workdir and script exist, and
the tasks' fixed ports are free there, and (SSH hosts) it has the GPUs its tasks are given; it
reports the CPUs it gives the run, its NUMA nodes and its GPUs' (`cpus_of`: the tasks' CPU split).
Every problem on every machine becomes one line naming it,
all reported together in one HostError (exit 2: nothing was started).

`probe_all` is that check; a `Probe` says how one kind of machine is reached: `SshProbe` here
(over the run's ssh session), the node probe in slurm.py (a job step). `check` is the SSH hosts'
preflight. The SSH probe opens the host's master connection; the host's agent (started before
any task, as the host's firewall guard) rides it.
"""

from __future__ import annotations

import json
import secrets
import shlex
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import ClassVar, Protocol

from distlaunch.host import remote
from distlaunch.launcher.core.backends import TaskTransport
from distlaunch.launcher.core.errors import HostError, last_message
from distlaunch.launcher.plan import gpu_fit, placement, ports
from distlaunch.launcher.plan.cpu_fit import Topology, cpulist
from distlaunch.launcher.plan.placement import Placement
from distlaunch.launcher.spec.model import LoadedSpec, task_json_path
from distlaunch.launcher.transports.ssh.transport import Session, remote_python

PROBE_TIMEOUT_S = 60.0
# ssh's own failures (exit 255) and what they mean for the user; the first match wins.
_SSH_FAILURES = (
    ("Permission denied", "authentication failed ({line}); check user and identity_file"),
    (
        "Host key verification failed",
        "host key verification failed: the host's key is not in known_hosts or has "
        'changed; add it (ssh-keyscan) or, for a new host, set "host_key_checking": "accept-new"',
    ),
    ("Could not resolve hostname", "unreachable: {line}"),
    ("No route to host", "unreachable: {line}"),
    ("Connection timed out", "unreachable: {line}"),
    ("Connection refused", "unreachable: {line}"),
    ("Network is unreachable", "unreachable: {line}"),
)


@dataclass(frozen=True)
class HostReport:
    """What one machine's probe found: problems (one line each), picked ports, versions."""

    name: str
    problems: tuple[str, ...]
    ports: dict[ports.TaskKey, int] = field(default_factory=dict)
    facts: dict = field(default_factory=dict)

    def summary(self) -> str:
        """One line on what the machine runs and gives the run, e.g. ``python 3.11.7,
        tensorflow 2.21.0, distlaunch 0.1.0, CPUs 0-7 (2 NUMA nodes)``."""
        parts = [
            f"{key} {self.facts[key]}"
            for key in ("python", "tensorflow", "distlaunch")
            if key in self.facts
        ]
        if "topology" in self.facts:
            found = Topology.from_json(self.facts["topology"])
            nodes = len([n for n in found.nodes if n]) or 1
            parts.append(f"CPUs {cpulist(found.cpus)} ({nodes} NUMA node{'s' * (nodes > 1)})")
        return ", ".join(parts)


class Probe(Protocol):
    """How preflight runs `ssh_probe.py` on one kind of machine."""

    machine: str  # what one is called: "host", "node" (install ... "on every host")
    machines: str  # how HostError's first line counts them: "SSH hosts", "Slurm nodes"

    def label(self, name: str) -> str:
        """The machine ``name`` as its problem lines begin."""

    def request(self, name: str) -> dict:
        """The request keys that depend on the machine or its backend (``shared``, ``workdir``, ...)."""

    def run(self, name: str, request: dict) -> dict | str:
        """Run the probe on ``name`` with ``request``: its answer, or one line on why there is none."""

    def problems(self, report: HostReport) -> list[str]:
        """What the launcher finds wrong in the facts of a machine's answer, one line each."""


def probe_all(
    loaded: LoadedSpec, wanted: Mapping[str, ports.HostPorts], umask: int | None, probe: Probe
) -> list[HostReport]:
    """Probe every machine of ``wanted`` (its ports to check or pick), in parallel; raise
    HostError listing every problem. ``umask`` is the one the tasks will run with (what the probe
    creates follows it too)."""
    if not wanted:
        return []
    # Here, not at the top: a run with no remote machine starts without it.
    from concurrent.futures import ThreadPoolExecutor

    token_file, token = probe_token(loaded)
    common = {
        "shared_dir": str(loaded.shared_dir),
        "token_file": str(token_file) if token_file else None,
        "token": token,
        "script": str(loaded.script) if loaded.script else None,
        "umask": umask,
    }

    def one(name: str) -> HostReport:
        request = {
            "fixed_ports": list(wanted[name].fixed.values()),
            "auto_ports": len(wanted[name].auto),
            **common,
            **probe.request(name),
        }
        return _report(name, wanted[name], probe.run(name, request), probe.machine)

    try:
        with ThreadPoolExecutor(max_workers=len(wanted)) as pool:
            reports = list(pool.map(one, sorted(wanted)))
    finally:
        if token_file is not None:
            token_file.unlink(missing_ok=True)
    # The launcher's own checks of a machine's facts, once the probe itself found nothing.
    found = {r.name: [*r.problems] or probe.problems(r) for r in reports}
    problems = [f"{probe.label(name)}: {line}" for name, lines in found.items() for line in lines]
    if problems:
        failed = sum(1 for lines in found.values() if lines)
        raise HostError(
            f"preflight failed on {failed} of {len(reports)} {probe.machines}; nothing was started:",
            problems,
        )
    return reports


def check(loaded: LoadedSpec, session: Session, umask: int | None) -> list[HostReport]:
    """Probe every SSH host that has tasks, in parallel; raise HostError listing every problem."""
    placed = placement.on_hosts(loaded)
    gpus: dict[str, list[Placement]] = {}
    for row in placed.rows:
        if row.transport == TaskTransport.SSH and row.gpus:
            gpus.setdefault(row.host_name, []).append(row)
    probe = SshProbe(loaded, session, {name: tuple(rows) for name, rows in gpus.items()})
    return probe_all(loaded, ports.remote_requests(placed), umask, probe)


def picked_ports(reports: list[HostReport]) -> dict[ports.TaskKey, int]:
    """Every probed task's port, as its machine checked or picked it."""
    return {key: port for report in reports for key, port in report.ports.items()}


def cpus_of(loaded: LoadedSpec, reports: list[HostReport]) -> dict[str, Topology]:
    """What each probed machine gives the run (its CPUs, NUMA nodes, GPUs' nodes), by the address
    its tasks' placement rows name it by."""
    return {
        loaded.address_of(r.name): Topology.from_json(r.facts["topology"])
        for r in reports
        if "topology" in r.facts
    }


def probe_token(loaded: LoadedSpec) -> tuple[Path | None, str]:
    """A file only the launcher could have written in the shared dir, for machines to look for."""
    token = secrets.token_hex(16)
    if not loaded.spec.shared_dir_is_shared:
        return None, token
    loaded.shared_dir.mkdir(parents=True, exist_ok=True)
    path = loaded.shared_dir / f".distlaunch-probe-{token[:8]}"
    path.write_text(token, encoding="utf-8")
    return path, token


def probe_source() -> str:
    """The probe's source (`ssh_probe.py`), to run by a machine's own Python."""
    return resources.files("distlaunch.launcher.transports.ssh").joinpath("probe.py").read_text()


def _report(name: str, wanted: ports.HostPorts, answer: dict | str, machine: str) -> HostReport:
    """What ``answer`` (the probe's, or why there is none) says of machine ``name``."""
    if isinstance(answer, str):
        return HostReport(name, (answer,))
    problems = list(answer["problems"])
    facts = answer["facts"]
    if "protocol" in facts and facts["protocol"] != remote.PROTOCOL:
        problems.append(
            f"distlaunch {facts.get('distlaunch')} there speaks protocol {facts['protocol']}, this launcher "
            f"{remote.PROTOCOL}; install the same distlaunch version on every {machine}"
        )
    picked = dict(wanted.fixed)
    picked.update(zip(wanted.auto, answer["ports"], strict=True))
    return HostReport(name, tuple(problems), picked, facts)


@dataclass(frozen=True)
class SshProbe:
    """The probe of SSH hosts: ``PYTHON - REQUEST`` over the run's ssh session, its source on stdin."""

    machine: ClassVar[str] = "host"
    machines: ClassVar[str] = "SSH hosts"

    loaded: LoadedSpec
    session: Session
    gpus: Mapping[str, tuple[Placement, ...]]  # by host: its tasks that have GPUs

    def label(self, name: str) -> str:
        """``name (user@address:port)``."""
        return self.session.target(name)

    def request(self, name: str) -> dict:
        """The host's own workdir; whether it shares the run dir is the spec's say; its GPUs
        counted where its tasks have some."""
        return {
            "shared": self.loaded.spec.shared_dir_is_shared,
            "workdir": self.session.hosts[name].workdir,
            "count_gpus": name in self.gpus,
            "read_cpus": True,
        }

    def problems(self, report: HostReport) -> list[str]:
        """A task given a GPU the host lacks (see `plan.gpu_fit`), by its JSON path."""
        have = int(report.facts.get("gpus", 0))
        row = gpu_fit.misfit(self.gpus.get(report.name, ()), have)
        if row is None:
            return []
        where = task_json_path(self.loaded.raw, row.role, row.index, "gpus")
        none = "the host has none (no NVIDIA driver found)"
        return [f"{where}: {gpu_fit.problem(row, have, 'the host', none)}"]

    def run(self, name: str, request: dict) -> dict | str:
        """Run the probe over ssh: its last stdout line, or what went wrong in words."""
        host = self.session.hosts[name]
        command = f"exec {remote_python(host.python)} - {shlex.quote(json.dumps(request))}"
        timeout = host.connect_timeout_s + PROBE_TIMEOUT_S
        try:
            # It opens the host's master connection, which the host's agent then rides: one
            # handshake per host (the client's share of one costs 65 ms of CPU with OpenSSH 9's
            # default key exchange, sntrup761x25519; a hundred hosts would pay it twice).
            done = self.session.run(name, command, stdin=probe_source().encode(), timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            # A login shell that prints and never runs the probe (a loop in ~/.bashrc) says so.
            said = [
                x for x in (exc.stdout or b"").decode(errors="replace").splitlines() if x.strip()
            ]
            printed = (
                f"; the host printed {said[-1].strip()[:120]!r} and nothing else" if said else ""
            )
            return f"no answer within {timeout:g} s{printed}"
        stderr = done.stderr.decode(errors="replace")
        if done.returncode == 255:
            return _ssh_failure(stderr)
        if done.returncode in (126, 127):
            why = "not found" if done.returncode == 127 else "not executable"
            return f"python {host.python!r} {why} on the host ($.hosts.{name}.python)"
        try:
            return json.loads(done.stdout.decode(errors="replace").strip().splitlines()[-1])
        except (IndexError, ValueError):
            return f"the probe failed (exit code {done.returncode}): {last_message(stderr) or 'no message'}"


def _ssh_failure(stderr: str) -> str:
    line = last_message(stderr) or "no message"
    for needle, message in _SSH_FAILURES:
        if needle in stderr:
            return message.format(line=line)
    return f"ssh failed: {line}"
