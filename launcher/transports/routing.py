"""One transport for the supervisor over several: each task goes to the transport of its host."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

from distlaunch.launcher.plan import TaskPlan


class Transport(Protocol):
    """What the supervisor needs of a transport (LocalTransport, SshTransport)."""

    def start(self, task: TaskPlan) -> Any:
        """Start one task and return its handle."""

    def stop(self, handles: Sequence[Any], grace_s: float) -> None:
        """Stop these tasks: SIGTERM, ``grace_s``, SIGKILL."""

    def kill(self, handles: Sequence[Any]) -> None:
        """Kill these tasks now, wherever they run, and reap their local processes."""


class HostRouter:
    """Starts local tasks with ``local`` and SSH tasks with ``ssh``; stops both at once."""

    def __init__(self, local: Transport, ssh: Transport | None) -> None:
        self.local = local
        self.ssh = ssh

    def start(self, task: TaskPlan) -> Any:
        """Start ``task`` with the transport of its host."""
        return self._for(task).start(task)

    def stop(self, handles: Sequence[Any], grace_s: float) -> None:
        """Stop every handle with its own transport, the transports side by side, so that the
        grace periods overlap instead of adding up."""
        groups: dict[int, tuple[Transport, list[Any]]] = {}
        for handle in handles:
            transport = self._for(handle.task)
            groups.setdefault(id(transport), (transport, []))[1].append(handle)
        threads = [
            threading.Thread(target=transport.stop, args=(group, grace_s), name="stop")
            for transport, group in list(groups.values())[1:]
        ]
        for thread in threads:
            thread.start()
        if groups:
            transport, group = next(iter(groups.values()))
            transport.stop(group, grace_s)
        for thread in threads:
            thread.join()

    def kill(self, handles: Sequence[Any]) -> None:
        """Kill every handle with its own transport."""
        for handle in handles:
            self._for(handle.task).kill([handle])

    def _for(self, task: TaskPlan) -> Transport:
        if task.transport != "ssh":
            return self.local
        if self.ssh is None:
            raise ValueError(f"{task.name} runs on SSH host {task.host_name!r} but the run has no SSH transport")
        return self.ssh
