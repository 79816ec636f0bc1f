"""Port allocation for tasks: fixed ports are checked free, `auto` ports are picked unused."""

from __future__ import annotations

import portpicker

from distlaunch.launcher.errors import SpecError
from distlaunch.launcher.spec import LoadedSpec, task_json_path

TaskKey = tuple[str, int]


def allocate(loaded: LoadedSpec) -> dict[TaskKey, int]:
    """Return a port for every task; raise SpecError when a fixed port is already in use.

    TensorFlow's gRPC server binds every interface whatever TF_CONFIG names, so a port counts as
    free only when it is free on all of them (portpicker checks exactly that).
    """
    ports: dict[TaskKey, int] = {}
    for role, entries in loaded.spec.tasks.by_role().items():
        for index, entry in enumerate(entries):
            if isinstance(entry.port, int):
                if not portpicker.is_port_free(entry.port):
                    raise SpecError(
                        str(loaded.file),
                        task_json_path(loaded.raw, role, index, "port"),
                        f"port {entry.port} is in use on this machine; expected a free port or \"auto\"",
                    )
                ports[(role, index)] = entry.port
    taken = set(ports.values())
    for role, entries in loaded.spec.tasks.by_role().items():
        for index, entry in enumerate(entries):
            if entry.port == "auto":
                port = portpicker.pick_unused_port()
                while port in taken:
                    port = portpicker.pick_unused_port()
                taken.add(port)
                ports[(role, index)] = port
    return ports
