"""`distlaunch collect`: copy the run files SSH hosts kept on their own disks back into the run dir.

Used when the spec says `"shared_dir_is_shared": false`: each host wrote its tasks' checkpoints,
status, metrics and error files under the run dir's path on its own disk. They are copied into
``<run dir>/hosts/<host>/`` (one folder per host, so that nothing one host wrote can overwrite
another's or the launcher's files).

The copy is `tar` on the host streamed over the same ssh options the run used, unpacked here
with tarfile's "data" filter, which refuses absolute paths, `..`, links out of the folder and
device files: a host's files are data, never trusted to say where they go.
"""

from __future__ import annotations

import shlex
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

from distlaunch.launcher.core.errors import HostError, UsageError, last_message
from distlaunch.launcher.record.state import RunRecord
from distlaunch.launcher.transports.local.routing import LocalBackend
from distlaunch.launcher.transports.ssh import transport as ssh

HOSTS_DIR = "hosts"


@dataclass(frozen=True)
class Collected:
    """What came back from one host."""

    host: str
    files: int
    bytes: int
    into: Path


def collect(run_dir: Path) -> list[Collected]:
    """Copy every SSH host's run files into ``run_dir/hosts/<host>/``; HostError names each host that failed."""
    record = RunRecord.load(run_dir)
    kept = LocalBackend().section(record)
    if kept is None or not kept.hosts:
        raise UsageError(f"run {record.run_id} has no tasks on SSH hosts; nothing to collect")
    if kept.shared_dir_is_shared:
        raise UsageError(
            f"run {record.run_id}: its SSH hosts share the run dir; everything is already in {run_dir}"
        )
    remote_dir = record.plan.get("run_dir") or str(run_dir)
    out, problems = [], []
    with ssh.Session(dict(kept.hosts)) as session:
        for name in sorted(session.hosts):
            try:
                out.append(_copy(session, name, remote_dir, run_dir / HOSTS_DIR / name))
            except _CopyFailed as exc:
                problems.append(f"{session.target(name)}: {exc}")
    if problems:
        raise HostError(
            f"collect failed on {len(problems)} of {len(session.hosts)} SSH hosts:", problems
        )
    return out


class _CopyFailed(Exception):
    pass


def _copy(session: ssh.Session, name: str, remote_dir: str, into: Path) -> Collected:
    into.mkdir(parents=True, exist_ok=True)
    argv = session.argv(name, f"exec tar -C {shlex.quote(remote_dir)} -cf - .")
    files = size = 0
    broken: tarfile.TarError | None = None
    with subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        try:
            with tarfile.open(fileobj=proc.stdout, mode="r|") as archive:
                for member in archive:
                    archive.extract(member, into, filter="data")
                    if member.isfile():
                        files += 1
                        size += member.size
        except tarfile.TarError as exc:  # tar failed there (its message is on stderr), or bad data
            broken = exc
            proc.kill()
        message = last_message(proc.stderr.read().decode(errors="replace"))
        code = proc.wait()
    if broken is not None or code != 0:
        raise _CopyFailed(
            message or f"no usable archive from the host ({broken or f'exit code {code}'})"
        )
    return Collected(name, files, size, into)
