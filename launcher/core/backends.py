"""The registry of backends: every name the spec's `backend` and `up --backend` accept.

A backend is one class (`transports.base.Backend`) in or next to its transport module; this
module only names them, so that the spec, the CLI and run.json can know which backends exist
without importing any (a start imports its own backend alone). The built-ins are listed here;
another package adds one through the entry-point group ``distlaunch.backends`` (name = the
backend's name, value = ``module:Class``). Entry points are scanned only for a name that is not
built in, and for the full list (`names`: `up --help`, `distlaunch schema`, an error message).
"""

from __future__ import annotations

import enum
import functools
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ENTRY_POINTS = "distlaunch.backends"
DEFAULT = "local"


@dataclass(frozen=True)
class Entry:
    """What the registry knows of a backend before its module is imported."""

    name: str
    target: str  # "module:Class" of its `transports.base.Backend`
    section: str | None = None  # the run.json key of its own section (`RunRecord.section`)
    # Facts the spec's checks need (spec/model.py), so that loading a spec imports no backend:
    hosts_are_nodes: bool = False  # a task's `host` names a node it allocates, not $.hosts
    own_python: bool = False  # it brings the interpreter: program.python is not checked here
    resizes: bool = False  # it can run an elastic spec (re-form a world at another size)


BUILTIN: Mapping[str, Entry] = {
    e.name: e
    for e in (
        Entry(
            "local",
            "distlaunch.launcher.transports.local.routing:LocalBackend",
            section="ssh",
            resizes=True,
        ),
        Entry(
            "compose",
            "distlaunch.launcher.transports.compose.transport:ComposeBackend",
            section="compose",
            own_python=True,
        ),
        Entry(
            "slurm",
            "distlaunch.launcher.transports.slurm.transport:SlurmBackend",
            section="slurm",
            hosts_are_nodes=True,
            resizes=True,
        ),
    )
}


class TaskTransport(enum.StrEnum):
    """How one task of a plan runs (`TaskPlan.transport`), as the backends above start it."""

    LOCAL = "local"  # a process on this machine (the local backend)
    SSH = "ssh"  # argv and cwd are paths on an SSH host (the local backend)
    COMPOSE = "compose"  # in a container of its own (the compose backend)
    SLURM = "slurm"  # a job step on a node of the allocation (the slurm backend)
    POD = "pod"  # a Kubernetes pod, started by Kubernetes from `distlaunch k8s`'s manifests

    @property
    def guarded(self) -> bool:
        """Whether its host gets a firewall guard (launcher/network/firewall.py): it runs on another
        machine the launcher reaches; a local task's ports are the isolation's, a container's
        the compose network's."""
        return self in (TaskTransport.SSH, TaskTransport.SLURM)

    @property
    def sees_launcher_files(self) -> bool:
        """Whether the task's machine has this launcher's files at their paths (this machine, or a
        Slurm cluster's shared filesystem): its bootstrap runs by path there, so its interpreter
        need not have distlaunch installed."""
        return self in (TaskTransport.LOCAL, TaskTransport.SLURM)

    @property
    def contained(self) -> bool:
        """Whether it runs in a container (what `up` says of a run whose tasks all do)."""
        return self is TaskTransport.COMPOSE


class UnknownBackend(ValueError):
    """A backend name no built-in and no installed entry point has."""


def names() -> tuple[str, ...]:
    """Every backend's name: the built-ins, then the installed ones (scans the entry points)."""
    return (*BUILTIN, *(n for n in _plugins() if n not in BUILTIN))


def entry(name: str) -> Entry:
    """The backend called ``name``; UnknownBackend when there is none."""
    found = BUILTIN.get(name)
    if found is not None:
        return found
    plugins = _plugins()
    if name not in plugins:
        raise UnknownBackend(f"expected one of {', '.join(map(repr, names()))}, got {name!r}")
    target = plugins[name]
    cls = load_class(target)
    return Entry(
        name,
        target,
        section=getattr(cls, "section_key", None),
        hosts_are_nodes=bool(getattr(cls, "hosts_are_nodes", False)),
        own_python=bool(getattr(cls, "own_python", False)),
        resizes=bool(getattr(cls, "resizes", False)),
    )


def load_class(target: str) -> Any:
    """The class ``target`` (``module:Class``) names, its module imported."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def recorded(data: Mapping[str, Any]) -> str:
    """The backend that wrote run.json ``data``: its ``backend`` key, or for a record written
    before that key existed, the built-in whose section it holds (none: the local backend)."""
    name = data.get("backend")
    if isinstance(name, str) and name:
        return name
    return next((e.name for e in BUILTIN.values() if e.section and e.section in data), DEFAULT)


@functools.cache
def _plugins() -> dict[str, str]:
    """The installed backends: entry-point name -> ``module:Class``."""
    from importlib.metadata import entry_points

    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINTS)}
