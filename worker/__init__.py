"""distlaunch.worker: the runtime a training script imports to run as a task of a distlaunch job.

Typical use (Keras 3)::

    import distlaunch.worker as dw

    strategy = dw.strategy()          # first TF op of the process; reports "ready"
    with strategy.scope():
        model = build_and_compile_model()
    dw.fit(model, dataset, global_batch_size=64, epochs=3, steps_per_epoch=20)

The same script runs under MultiWorkerMirroredStrategy (every worker trains) and
ParameterServerStrategy (on ps and worker tasks ``dw.strategy()`` serves and never returns; the
chief runs the rest and schedules the steps). An evaluator task calls
``dw.evaluate_checkpoints(model, eval_dataset)`` instead of ``dw.fit``.

Importing this package installs an error hook (uncaught exceptions are also written to
DISTLAUNCH_ERROR_FILE) and nothing else: the public names below are imported lazily, on first
use, so that ``import distlaunch.worker.contract`` (the launcher does this) never imports
TensorFlow.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import runtime

# Public name -> submodule that defines it; `train` and `evaluator` import TensorFlow, `runtime`,
# `elastic` and `strategies` do not (a strategy's builder does, when called).
_EXPORTS = {
    "TaskContext": "runtime",
    "context": "runtime",
    "report": "runtime",
    "strategy": "strategies",
    "checkpoint_dir_for_this_task": "runtime",
    "fit": "train",
    "keras_callbacks": "train",
    "evaluate_checkpoints": "evaluator",
    "global_batch_size": "elastic",
}

__all__ = sorted(_EXPORTS)

runtime.install_error_hook()


def __getattr__(name: str) -> Any:
    """Import a public name's submodule on first access (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """List the lazy public names along with the module's own."""
    return sorted(set(globals()) | set(_EXPORTS))
