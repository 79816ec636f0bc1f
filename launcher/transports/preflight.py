"""Preflight: before anything starts, check every SSH host at once and pick its `auto` ports there.

Each host runs `ssh_probe.py` with its own Python, all hosts in parallel: the host is reachable
and accepts the key, its Python imports distlaunch at this launcher's protocol and finds
TensorFlow, it sees the shared dir (or can write its own copy), the workdir and script exist, and
the tasks' fixed ports are free there. Every problem on every host becomes one line naming the
host, all reported together in one HostError (exit 2: nothing was started).

The probe's ssh is also the host's first connection of the run: it becomes the master that the
tasks' sessions share.
"""

from __future__ import annotations

import json
import secrets
import shlex
import subprocess
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from distlaunch.launcher import ports
from distlaunch.launcher.errors import HostError, last_message
from distlaunch.launcher.spec import LoadedSpec
from distlaunch.launcher.transports.ssh import Session, remote_python
from distlaunch.worker import remote

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
    """What one host's probe found: problems (one line each), picked ports, versions."""

    name: str
    problems: tuple[str, ...]
    ports: dict[ports.TaskKey, int] = field(default_factory=dict)
    facts: dict = field(default_factory=dict)

    def summary(self) -> str:
        """One line on what the host runs, e.g. ``python 3.11.7, tensorflow 2.21.0, distlaunch 0.1.0``."""
        return ", ".join(
            f"{key} {self.facts[key]}"
            for key in ("python", "tensorflow", "distlaunch")
            if key in self.facts
        )


def check(loaded: LoadedSpec, session: Session, umask: int | None) -> list[HostReport]:
    """Probe every SSH host that has tasks, in parallel; raise HostError listing every problem.

    ``umask`` is the one the tasks will run with (what the probe creates follows it too).
    """
    requests = ports.remote_requests(loaded)
    if not requests:
        return []
    # Here, not at the top: a run with no SSH host starts without it.
    from concurrent.futures import ThreadPoolExecutor

    token_file, token = probe_token(loaded)
    try:
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            reports = list(
                pool.map(
                    lambda name: _probe(
                        loaded, session, name, requests[name], token_file, token, umask
                    ),
                    sorted(requests),
                )
            )
    finally:
        if token_file is not None:
            token_file.unlink(missing_ok=True)
    problems = [f"{session.target(r.name)}: {line}" for r in reports for line in r.problems]
    if problems:
        failed = sum(1 for r in reports if r.problems)
        raise HostError(
            f"preflight failed on {failed} of {len(reports)} SSH hosts; nothing was started:",
            problems,
        )
    return reports


def picked_ports(reports: list[HostReport]) -> dict[ports.TaskKey, int]:
    """Every SSH task's port, as its host checked or picked it."""
    return {key: port for report in reports for key, port in report.ports.items()}


def probe_token(loaded: LoadedSpec) -> tuple[Path | None, str]:
    """A file only the launcher could have written in the shared dir, for hosts to look for."""
    token = secrets.token_hex(16)
    if not loaded.spec.shared_dir_is_shared:
        return None, token
    loaded.shared_dir.mkdir(parents=True, exist_ok=True)
    path = loaded.shared_dir / f".distlaunch-probe-{token[:8]}"
    path.write_text(token, encoding="utf-8")
    return path, token


def _probe(
    loaded: LoadedSpec,
    session: Session,
    name: str,
    wanted: ports.HostPorts,
    token_file: Path | None,
    token: str,
    umask: int | None,
) -> HostReport:
    host = session.hosts[name]
    request = {
        "fixed_ports": list(wanted.fixed.values()),
        "auto_ports": len(wanted.auto),
        "shared_dir": str(loaded.shared_dir),
        "shared": loaded.spec.shared_dir_is_shared,
        "token_file": str(token_file) if token_file else None,
        "token": token,
        "workdir": host.workdir,
        "script": str(loaded.script) if loaded.script else None,
        "umask": umask,
    }
    source = resources.files("distlaunch.launcher.transports").joinpath("ssh_probe.py").read_bytes()
    command = f"exec {remote_python(host.python)} - {shlex.quote(json.dumps(request))}"
    try:
        done = session.run(
            name, command, stdin=source, timeout=host.connect_timeout_s + PROBE_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return HostReport(
            name, (f"no answer within {host.connect_timeout_s + PROBE_TIMEOUT_S:g} s",)
        )
    stderr = done.stderr.decode(errors="replace")
    if done.returncode == 255:
        return HostReport(name, (_ssh_failure(stderr),))
    if done.returncode in (126, 127):
        why = "not found" if done.returncode == 127 else "not executable"
        return HostReport(
            name, (f"python {host.python!r} {why} on the host ($.hosts.{name}.python)",)
        )
    try:
        answer = json.loads(done.stdout.decode(errors="replace").strip().splitlines()[-1])
    except (IndexError, ValueError):
        return HostReport(
            name,
            (
                f"the probe failed (exit code {done.returncode}): {last_message(stderr) or 'no message'}",
            ),
        )
    problems = list(answer["problems"])
    facts = answer["facts"]
    if "protocol" in facts and facts["protocol"] != remote.PROTOCOL:
        problems.append(
            f"distlaunch {facts.get('distlaunch')} there speaks protocol {facts['protocol']}, this launcher "
            f"{remote.PROTOCOL}; install the same distlaunch version on every host"
        )
    picked = dict(wanted.fixed)
    picked.update(zip(wanted.auto, answer["ports"], strict=True))
    return HostReport(name, tuple(problems), picked, facts)


def _ssh_failure(stderr: str) -> str:
    line = last_message(stderr) or "no message"
    for needle, message in _SSH_FAILURES:
        if needle in stderr:
            return message.format(line=line)
    return f"ssh failed: {line}"
