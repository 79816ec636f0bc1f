"""The docker CLI as the launcher uses it: one way to run a docker command, and which compose is here.

The compose backend drives the `docker` and compose command lines rather than the engine's API:
they are what a user has installed and what they would type, so every step the launcher takes
can be repeated by hand from run.json and the run dir's docker.log.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from distlaunch.launcher.core.errors import LaunchError

# How much of a failed command's stderr goes into the error message.
_ERROR_LINES = 8


class DockerError(LaunchError):
    """Docker cannot do what the run needs: no engine, no compose, a failed build or command.

    Exit 2, like HostError: it is raised before any task starts, and the fix is on this machine.
    """


def docker(*args: str, check: bool = True, log: Path | None = None) -> str:
    """Run ``docker ARGS`` and return its stdout; raise DockerError when it fails and ``check``.

    With ``log``, stdout and stderr are appended to that file instead (for long outputs such as
    a build), and the error message names the file.
    """
    return run(("docker", *args), check=check, log=log)


def run(argv: Sequence[str], check: bool = True, log: Path | None = None) -> str:
    """Run a docker or compose command line (see `docker`)."""
    try:
        if log is None:
            done = subprocess.run(
                list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True
            )
        else:
            with open(log, "a", encoding="utf-8") as f:
                f.write(f"$ {' '.join(argv)}\n")
                f.flush()
                done = subprocess.run(
                    list(argv),
                    stdin=subprocess.DEVNULL,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
    except FileNotFoundError:
        raise DockerError(
            f"{argv[0]} is not installed (the compose backend needs Docker and docker-compose)"
        ) from None
    if check and done.returncode != 0:
        err = done.stderr if log is None else log.read_text(encoding="utf-8", errors="replace")
        where = f" (log: {log})" if log is not None else ""
        raise DockerError(
            f"`{' '.join(argv[:4])} ...` failed with exit code {done.returncode}{where}:\n{_tail(err)}"
        )
    return done.stdout or ""


def container_pid(container: str) -> int | None:
    """The host pid of a running container's first process; None when it is not running (yet)."""
    out = docker("inspect", "--format", "{{.State.Pid}}", container, check=False).strip()
    return int(out) if out.isdigit() and int(out) > 0 else None


@functools.cache
def compose_command() -> tuple[str, ...]:
    """The compose command line here, detected once: ``docker compose`` (v2), else ``docker-compose`` (v1).

    Both take the same subcommands and flags the launcher uses (-p, -f, up, run, down, config).
    """
    engine_version()
    if (
        subprocess.run(
            ["docker", "compose", "version"], stdin=subprocess.DEVNULL, capture_output=True
        ).returncode
        == 0
    ):
        return ("docker", "compose")
    if shutil.which("docker-compose") is not None:
        return ("docker-compose",)
    raise DockerError("neither `docker compose` (v2) nor `docker-compose` (v1) is installed")


@functools.cache
def engine_version() -> str:
    """The Docker engine's version; DockerError when the CLI is missing or cannot reach the engine."""
    try:
        return docker("version", "--format", "{{.Server.Version}}").strip()
    except DockerError as exc:
        raise DockerError(f"cannot reach the Docker engine: {exc}") from None


def _tail(text: str) -> str:
    return "\n".join(text.strip().splitlines()[-_ERROR_LINES:])
