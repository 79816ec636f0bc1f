"""What a task knows about itself and the files it reports through (status, errors).

This module is stdlib only (its strategy lives in `strategies`), so a script can read its
context, report its state and install the error hook cheaply.

Run by hand, without the launcher's DISTLAUNCH_* variables, a task still works: role and index
come from TF_CONFIG (or default to ``worker`` 0), the attempt is 0, the strategy is
ParameterServerStrategy when TF_CONFIG's cluster has ps tasks, MultiWorkerMirroredStrategy when
it names another cluster and TensorFlow's default strategy otherwise, and every file whose
variable is unset (status, error, metrics, checkpoints) is simply not written: nothing lands in
the current directory behind the user's back.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path
from types import TracebackType
from typing import Any

from . import contract

# Strategy name when neither DISTLAUNCH_STRATEGY nor a TF_CONFIG cluster is set: one process.
DEFAULT_STRATEGY = "default"

# Non-chief workers write their (discarded) checkpoint copies into `<checkpoint dir>/.tmp-<task>`.
# One directory per task, not a shared parent, so that removing it leaves nothing behind and no
# worker ever deletes a directory another worker is creating files in.
TEMP_CHECKPOINT_PREFIX = ".tmp-"


@dataclasses.dataclass(frozen=True)
class TaskContext:
    """Who this task is in its run, read from the launcher's environment (see module docstring)."""

    role: str
    index: int
    attempt: int
    run_id: str
    run_dir: Path | None
    strategy: str
    keras: str
    is_chief: bool
    num_workers: int
    checkpoint_dir: Path | None
    # The workers the program's numbers were written for: an elastic run's MAX (its world,
    # num_workers, may be smaller), else num_workers. For scaling a learning rate with the world.
    base_workers: int = 1

    @property
    def name(self) -> str:
        """Return the task's name in logs and files, e.g. ``worker-1``."""
        return contract.task_name(self.role, self.index)


def context() -> TaskContext:
    """Return this task's TaskContext, read from the environment on every call (it is cheap)."""
    tf_config = json.loads(os.environ.get(contract.TF_CONFIG) or "{}")
    cluster: dict[str, list[str]] = tf_config.get("cluster", {})
    task: dict[str, Any] = tf_config.get("task", {})
    role = os.environ.get(contract.ROLE) or task.get("type") or "worker"
    index = int(os.environ.get(contract.INDEX) or task.get("index") or 0)
    strategy_name = os.environ.get(contract.STRATEGY) or _strategy_of(cluster)
    num_workers = _num_workers(cluster, strategy_name)
    base = os.environ.get(contract.BASE_WORKERS, "")
    return TaskContext(
        role=role,
        index=index,
        attempt=int(os.environ.get(contract.ATTEMPT) or 0),
        run_id=os.environ.get(contract.RUN_ID) or "local",
        run_dir=contract.env_path(contract.RUN_DIR),
        strategy=strategy_name,
        keras=_keras_flavour(),
        # The TF rule: the `chief` task, or worker 0 when the cluster has no chief.
        is_chief=role == "chief" or (role == "worker" and index == 0 and "chief" not in cluster),
        num_workers=num_workers,
        checkpoint_dir=contract.env_path(contract.CHECKPOINT_DIR),
        base_workers=int(base) if base.isdigit() and int(base) > 0 else num_workers,
    )


def _strategy_of(cluster: dict[str, list[str]]) -> str:
    """Return the strategy a TF_CONFIG cluster implies when DISTLAUNCH_STRATEGY is unset."""
    if contract.PS in cluster:
        return contract.PSS
    return contract.MWMS if cluster else DEFAULT_STRATEGY


def _keras_flavour() -> str:
    """Return DISTLAUNCH_KERAS, else tf_keras when TF_USE_LEGACY_KERAS asks for it, else keras3."""
    flavour = os.environ.get(contract.KERAS)
    if flavour:
        return flavour
    legacy = os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true", "yes")
    return contract.TF_KERAS if legacy else contract.KERAS3


def _num_workers(cluster: dict[str, list[str]], strategy_name: str) -> int:
    """Return how many tasks run training steps: under PSS the chief only coordinates."""
    workers = len(cluster.get("worker", []))
    if strategy_name != contract.PSS:
        workers += len(cluster.get("chief", []))
    return max(workers, 1)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` so that readers never see a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def report(state: str, **fields: Any) -> None:
    """Write this task's status file: ``state``, ``time`` (the heartbeat), ``pid``, ``attempt``
    and ``fields`` (e.g. ``step``). The launcher reads ``state == "ready"`` as "joined its
    cluster". A no-op when DISTLAUNCH_STATUS_FILE is unset."""
    path = contract.env_path(contract.STATUS_FILE)
    if path is None:
        return
    status = {
        "state": state,
        "time": time.time(),
        "pid": os.getpid(),
        "attempt": context().attempt,
        **fields,
    }
    write_json_atomic(path, status)


def checkpoint_dir_for_this_task(ctx: TaskContext | None = None) -> Path | None:
    """Return the directory this task writes checkpoints to, or None without a checkpoint dir.

    Every worker must take part in a save (saving may run collective ops), but only the
    chief's copy is kept: the chief writes into DISTLAUNCH_CHECKPOINT_DIR, the others into a
    private ``.tmp-<task>`` directory inside it, which the caller removes after each save. All
    workers restore from the chief's directory, ``ctx.checkpoint_dir``.
    """
    ctx = ctx or context()
    if ctx.checkpoint_dir is None or ctx.is_chief:
        return ctx.checkpoint_dir
    return ctx.checkpoint_dir / f"{TEMP_CHECKPOINT_PREFIX}{ctx.name}"


def install_error_hook() -> None:
    """Wrap sys.excepthook so that an uncaught exception is also written, as JSON, to
    DISTLAUNCH_ERROR_FILE before the previous hook prints it. Installing twice is a no-op."""
    previous = sys.excepthook
    if getattr(previous, "_distlaunch_hook", False):
        return

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        try:
            _write_error_file(exc_type, exc, tb)
        except Exception as error:  # noqa: BLE001 - the original error must still be printed
            print(f"distlaunch: could not write the error file: {error!r}", file=sys.stderr)
        previous(exc_type, exc, tb)

    hook._distlaunch_hook = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _write_error_file(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    """Record an uncaught exception where the launcher looks for it; no-op without the variable."""
    path = contract.env_path(contract.ERROR_FILE)
    if path is None:
        return
    ctx = context()
    module = exc_type.__module__
    write_json_atomic(
        path,
        {
            "type": (
                exc_type.__qualname__
                if module == "builtins"
                else f"{module}.{exc_type.__qualname__}"
            ),
            "message": str(exc),
            "traceback": "".join(traceback.format_exception(exc_type, exc, tb)),
            "time": time.time(),
            "pid": os.getpid(),
            "role": ctx.role,
            "index": ctx.index,
            "attempt": ctx.attempt,
        },
    )
