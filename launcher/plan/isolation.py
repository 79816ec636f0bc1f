"""How a run's tasks are isolated from the network, decided from the spec and the machine.

Pure data and a pure decision, for the plan (which records it) and `distlaunch plan` (which
shows it). Making the private namespace is the local transport's (network/netns.py), which
also probes what this machine allows.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for annotations: this module imports nothing heavy
    from distlaunch.launcher.plan.placement import Placements
    from distlaunch.launcher.spec.model import LoadedSpec

# Isolation modes, as `plan` and run.json show them.
NETNS = "netns"  # a private network namespace (root, or CAP_SYS_ADMIN)
USERNS = "userns"  # a private network namespace inside a new user namespace (unprivileged)
HOST = "host"  # tasks share the machine's network: their ports are reachable from outside


@dataclass(frozen=True)
class Capabilities:
    """What this machine lets the current user do, probed once (see `probe`)."""

    netns: bool  # `unshare --net` works
    userns: bool  # `unshare --user --map-root-user --net` works
    detail: str  # why neither works (empty when one does)


@dataclass(frozen=True)
class Isolation:
    """How a run's tasks are isolated, and why."""

    mode: str  # NETNS, USERNS or HOST
    reason: str
    remedy: str = ""  # how to keep the ports private when mode is HOST

    @property
    def private(self) -> bool:
        """Whether the tasks run in a private network namespace."""
        return self.mode != HOST

    def to_json(self) -> dict:
        """Return the decision as JSON-ready data."""
        return {"mode": self.mode, "reason": self.reason}


# What a plan built without a decision describes: the tasks share the machine's network.
HOST_NETWORK = Isolation(HOST, "no isolation was requested", "firewall these ports")


def choose(loaded: LoadedSpec, placed: Placements, caps: Capabilities | None) -> Isolation:
    """Decide the isolation of a run from its spec, where its tasks run (``placed``) and this
    machine's capabilities ``caps``.

    Pure. Only a cluster wholly on this machine's loopback can be shut in: a task on another host,
    or at an address other hosts dial, must be reachable over the network. ``caps`` is looked at
    only when isolation is possible (pass None for "off").
    """
    if loaded.spec.isolation == "off":
        return Isolation(
            HOST,
            'the spec sets "isolation": "off"',
            'remove "isolation": "off" from the spec, or firewall these ports',
        )
    outside = _first_task_off_loopback(placed)
    if outside is not None:
        return Isolation(
            HOST,
            f"task {outside} is not on this machine's loopback, so the tasks must reach each other over the network",
            "firewall these ports on every host so that only the cluster's hosts reach them",
        )
    if caps is None:
        raise ValueError('isolation "auto" needs the machine\'s capabilities')
    if caps.netns:
        return Isolation(NETNS, "tasks share a private network namespace with loopback only")
    if caps.userns:
        return Isolation(
            USERNS,
            "tasks share a private network namespace (in a user namespace) with loopback only",
        )
    return Isolation(
        HOST,
        f"this machine cannot make a private network namespace for this user: {caps.detail}",
        "run as root or allow unprivileged user namespaces (the run then gets a private network namespace), "
        "or firewall these ports",
    )


def _first_task_off_loopback(placed: Placements) -> str | None:
    """The first task (``role:index at address``) whose address is not a loopback one, or None."""
    for row in placed.rows:
        try:
            loopback = ipaddress.ip_address(row.address).is_loopback
        except ValueError:
            loopback = row.address == "localhost"
        if not loopback:
            return f"{row.role}:{row.index} at {row.address}"
    return None
