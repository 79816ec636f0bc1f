"""The run's checkpoint folder as the launcher sees it, without TensorFlow: which checkpoint the
index names, and what saves cut short left behind.

TensorFlow's CheckpointManager writes ``ckpt-N.index`` and ``ckpt-N.data-*`` (a sharded save
first into a ``ckpt-N_temp/`` folder it renames from), then rewrites the text index file
``checkpoint`` atomically (``model_checkpoint_path: "ckpt-N"``): the index names a checkpoint
only once it is whole. What a save cut short leaves (``ckpt-N_temp/``, a non-chief worker's
``.tmp-<task>/`` copy) is never named by the index; once every task is gone it is nobody's.

A Keras 3 ``BackupAndRestore`` writes no index: under distlaunch's layer its chief's
``backup/training_metadata.json`` holds the optimizer's step (worker/keras3/callbacks.py).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from distlaunch.worker import contract

INDEX = "checkpoint"  # TensorFlow's index file in a checkpoint folder
_LATEST = re.compile(r'^model_checkpoint_path:\s*"([^"]*)"', re.M)
_STEP = re.compile(r"-(\d+)$")
# Left by saves cut short: TensorFlow's sharded-save folder, a non-chief worker's private copy
# (worker/runtime.py's TEMP_CHECKPOINT_PREFIX).
_CUT_SAVES = ("ckpt-*_temp", ".tmp-*")


@dataclass(frozen=True)
class Latest:
    """The checkpoint the index names as the latest."""

    name: str  # e.g. ckpt-26
    step: int


def latest(folder: Path) -> Latest | None:
    """The checkpoint ``folder``'s index names as the latest (a resume starts there); None
    without an index, or one that names no ``<name>-<step>``."""
    try:
        text = (folder / INDEX).read_text(errors="replace")
    except OSError:
        return None
    found = _LATEST.search(text)
    if found is None:
        return None
    name = Path(found.group(1)).name
    step = _STEP.search(name)
    return Latest(name, int(step.group(1))) if step else None


def keras_backup(folder: Path) -> Latest | None:
    """The step the Keras 3 backup in checkpoint ``folder`` holds; None without one, or one
    that names no step (written without distlaunch's layer)."""
    backup = contract.keras_backup_dir(folder)
    try:
        step = json.loads((backup / contract.KERAS_BACKUP_METADATA).read_text()).get(
            contract.KERAS_BACKUP_STEP
        )
    except (OSError, ValueError, AttributeError):
        return None
    return Latest(backup.name, step) if isinstance(step, int) and step >= 0 else None


def resume_point(folder: Path) -> Latest | None:
    """Where a resume from checkpoint ``folder`` starts: the checkpoint its index names, else
    the Keras 3 backup's step."""
    return latest(folder) or keras_backup(folder)


def remove_cut_saves(folder: Path) -> list[str]:
    """Remove what saves cut short left in ``folder`` (call it once no task runs); return the
    names removed."""
    removed = []
    for pattern in _CUT_SAVES:
        for path in sorted(folder.glob(pattern)):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
                removed.append(f"{path.name}/")
    return removed
