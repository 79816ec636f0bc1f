"""Port allocation for tasks: fixed ports are checked free, `auto` ports are picked unused.

Which tasks run where comes from the plan's placement table (launcher/plan/placement.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from distlaunch.launcher.core.backends import TaskTransport
from distlaunch.launcher.core.errors import SpecError
from distlaunch.launcher.plan.placement import Placement, Placements, TaskKey
from distlaunch.launcher.spec.model import LoadedSpec, task_json_path

# In a run's private network namespace nothing else listens, so `auto` ports are simply numbered
# from here. It lies below the kernel's default ephemeral range (32768-60999, what a fresh
# namespace has), so no task's outgoing connection can hold a port another task is to listen on.
FIRST_PRIVATE_PORT = 20000


@dataclass(frozen=True)
class HostPorts:
    """What one SSH host must do for its tasks' ports: check the fixed ones, pick the `auto` ones."""

    fixed: Mapping[TaskKey, int]
    auto: tuple[TaskKey, ...]


def remote_requests(placed: Placements) -> dict[str, HostPorts]:
    """For each SSH host with tasks, the ports its preflight must check or pick (on that host):
    the SSH rows of the local backend's placement (``placed``, `placement.on_hosts`)."""
    fixed: dict[str, dict[TaskKey, int]] = {}
    auto: dict[str, list[TaskKey]] = {}
    for row in placed.rows:
        if row.transport != TaskTransport.SSH:
            continue
        fixed.setdefault(row.host_name, {})
        auto.setdefault(row.host_name, [])
        if row.port is not None:
            fixed[row.host_name][row.key] = row.port
        else:
            auto[row.host_name].append(row.key)
    return {host: HostPorts(fixed[host], tuple(auto[host])) for host in fixed}


def allocate(
    loaded: LoadedSpec,
    placed: Placements,
    private: bool = False,
    remote: Mapping[TaskKey, int] | None = None,
) -> dict[TaskKey, int]:
    """Return a port for every task of ``placed``; raise SpecError when a fixed port is already
    in use on this machine.

    TensorFlow's gRPC server binds every interface whatever TF_CONFIG names, so a port counts as
    free only when it is free on all of them (portpicker checks exactly that). With ``private``
    (the tasks get a network namespace of their own) every port is free: none is checked, and
    `auto` ports are numbered from FIRST_PRIVATE_PORT.

    Tasks on SSH hosts take their port from ``remote``: the host's preflight checked or picked it
    there. Without it (`plan`'s dry run) a fixed port is taken as written and an `auto` one is
    picked on this machine as a stand-in.
    """
    ports: dict[TaskKey, int] = dict(remote or {})
    for row in placed.rows:
        if row.key in ports or row.port is None:
            continue
        local = row.transport == TaskTransport.LOCAL
        if local and not private and not _portpicker().is_port_free(row.port):
            raise SpecError(
                loaded.shown,
                task_json_path(loaded.raw, row.role, row.index, "port"),
                f'port {row.port} is in use on this machine; expected a free port or "auto"',
            )
        ports[row.key] = row.port
    taken = set(ports.values())
    next_private = FIRST_PRIVATE_PORT
    for row in placed.rows:
        if row.key in ports:
            continue
        if private:
            while next_private in taken:
                next_private += 1
            port = next_private
        else:
            port = _free_port(loaded, row, taken)
        taken.add(port)
        ports[row.key] = port
    return ports


def _free_port(loaded: LoadedSpec, row: Placement, taken: set[int]) -> int:
    """An unused port of this machine not in ``taken``; SpecError when none is left (thousands
    of `auto` ports: portpicker gives up rather than loop, and so does the plan)."""
    portpicker = _portpicker()
    try:
        port = portpicker.pick_unused_port()
        while port in taken:
            port = portpicker.pick_unused_port()
    except portpicker.NoFreePortFoundError:
        raise SpecError(
            loaded.shown,
            task_json_path(loaded.raw, row.role, row.index, "port"),
            f"no free port left on this machine for its task ({len(taken)} already taken); "
            "expected fewer tasks or fixed ports",
        ) from None
    return port


def _portpicker():
    """portpicker, imported on first use: an isolated run (every port free) never needs it, and
    its import (with logging's) is 2 ms of the launcher's start."""
    import portpicker

    return portpicker
