"""distlaunch from Python: start a cluster spec, or run a function on every task of a cluster.

::

    import distlaunch

    def step(scale):
        import tensorflow as tf
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        return strategy.cluster_resolver.task_id * scale

    distlaunch.run(step, 10, workers=2)   # {"worker-0": 0, "worker-1": 10}

    run = distlaunch.launch("cluster_specs/local2.json")   # a Run handle; returns at once
    run.wait().state                                        # "succeeded"
    distlaunch.up("cluster_specs/local2.json")              # blocks; raises RunFailed

Importing this package is cheap: no TensorFlow, and the launcher's modules are imported on first
use of a name below (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distlaunch.launcher.api.call import run
    from distlaunch.launcher.api.launch import Run, SpecInput, launch, up
    from distlaunch.launcher.api.pool import close as close_pool
    from distlaunch.launcher.api.results import (
        Failure,
        PicklingError,
        RunFailed,
        RunResult,
        StartError,
        TaskError,
    )
    from distlaunch.launcher.core.errors import LaunchError, SpecError, UsageError
    from distlaunch.launcher.run.options import LaunchOptions

# Public name -> module that defines it (with the name there, where it differs).
_EXPORTS = {
    "launch": "distlaunch.launcher.api.launch",
    "up": "distlaunch.launcher.api.launch",
    "Run": "distlaunch.launcher.api.launch",
    "run": "distlaunch.launcher.api.call",
    "close_pool": ("distlaunch.launcher.api.pool", "close"),
    "RunResult": "distlaunch.launcher.api.results",
    "Failure": "distlaunch.launcher.api.results",
    "RunFailed": "distlaunch.launcher.api.results",
    "TaskError": "distlaunch.launcher.api.results",
    "PicklingError": "distlaunch.launcher.api.results",
    "StartError": "distlaunch.launcher.api.results",
    "SpecError": "distlaunch.launcher.core.errors",
    "LaunchError": "distlaunch.launcher.core.errors",
    "UsageError": "distlaunch.launcher.core.errors",
    "SpecInput": "distlaunch.launcher.api.launch",
    "LaunchOptions": "distlaunch.launcher.run.options",
}

__all__ = [
    "Failure",
    "LaunchError",
    "LaunchOptions",
    "PicklingError",
    "Run",
    "RunFailed",
    "RunResult",
    "SpecError",
    "SpecInput",
    "StartError",
    "TaskError",
    "UsageError",
    "close_pool",
    "launch",
    "run",
    "up",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access."""
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = where if isinstance(where, tuple) else (where, name)
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """List the lazy public names along with the module's own."""
    return sorted(set(globals()) | set(_EXPORTS))
