"""Port allocation for tasks: fixed ports are checked free, `auto` ports are picked unused."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from distlaunch.launcher.errors import SpecError
from distlaunch.launcher.spec import LoadedSpec, task_json_path

TaskKey = tuple[str, int]

# In a run's private network namespace nothing else listens, so `auto` ports are simply numbered
# from here. It lies below the kernel's default ephemeral range (32768-60999, what a fresh
# namespace has), so no task's outgoing connection can hold a port another task is to listen on.
FIRST_PRIVATE_PORT = 20000


@dataclass(frozen=True)
class HostPorts:
    """What one SSH host must do for its tasks' ports: check the fixed ones, pick the `auto` ones."""

    fixed: Mapping[TaskKey, int]
    auto: tuple[TaskKey, ...]


def remote_requests(loaded: LoadedSpec) -> dict[str, HostPorts]:
    """For each SSH host with tasks, the ports its preflight must check or pick (on that host)."""
    fixed: dict[str, dict[TaskKey, int]] = {}
    auto: dict[str, list[TaskKey]] = {}
    for role, entries in loaded.spec.tasks.by_role().items():
        for index, entry in enumerate(entries):
            if loaded.ssh_host(entry.host) is None:
                continue
            fixed.setdefault(entry.host, {})
            auto.setdefault(entry.host, [])
            if isinstance(entry.port, int):
                fixed[entry.host][(role, index)] = entry.port
            else:
                auto[entry.host].append((role, index))
    return {host: HostPorts(fixed[host], tuple(auto[host])) for host in fixed}


def allocate(
    loaded: LoadedSpec, private: bool = False, remote: Mapping[TaskKey, int] | None = None
) -> dict[TaskKey, int]:
    """Return a port for every task; raise SpecError when a fixed port is already in use.

    TensorFlow's gRPC server binds every interface whatever TF_CONFIG names, so a port counts as
    free only when it is free on all of them (portpicker checks exactly that). With ``private``
    (the tasks get a network namespace of their own) every port is free: none is checked, and
    `auto` ports are numbered from FIRST_PRIVATE_PORT.

    Tasks on SSH hosts take their port from ``remote``: the host's preflight checked or picked it
    there. Without it (`plan`'s dry run) a fixed port is taken as written and an `auto` one is
    picked on this machine as a stand-in.
    """
    ports: dict[TaskKey, int] = dict(remote or {})
    for role, entries in loaded.spec.tasks.by_role().items():
        for index, entry in enumerate(entries):
            if (role, index) in ports:
                continue
            if isinstance(entry.port, int):
                local = loaded.ssh_host(entry.host) is None
                if local and not private and not _portpicker().is_port_free(entry.port):
                    raise SpecError(
                        str(loaded.file),
                        task_json_path(loaded.raw, role, index, "port"),
                        f'port {entry.port} is in use on this machine; expected a free port or "auto"',
                    )
                ports[(role, index)] = entry.port
    taken = set(ports.values())
    next_private = FIRST_PRIVATE_PORT
    for role, entries in loaded.spec.tasks.by_role().items():
        for index, entry in enumerate(entries):
            if entry.port == "auto" and (role, index) not in ports:
                if private:
                    while next_private in taken:
                        next_private += 1
                    port = next_private
                else:
                    port = _portpicker().pick_unused_port()
                    while port in taken:
                        port = _portpicker().pick_unused_port()
                taken.add(port)
                ports[(role, index)] = port
    return ports


def _portpicker():
    """portpicker, imported on first use: an isolated run (every port free) never needs it, and
    its import (with logging's) is 2 ms of the launcher's start."""
    import portpicker

    return portpicker
