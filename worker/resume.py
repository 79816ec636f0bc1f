"""Which checkpoint a resume starts from, when the checkpoint index may be damaged.

`tf.train.latest_checkpoint` reads the index file ``checkpoint`` and returns None, without a
word, when that file is missing, garbled, or names a checkpoint whose files are gone: training
would start over at step 0, save ``ckpt-20`` over an older one, and the CheckpointManager would
delete the checkpoints the index still lists. Here a whole checkpoint is one whose ``.index``
file and every ``.data-K-of-N`` shard are there; the index is trusted when it names a whole one.
Otherwise the resume starts from the newest whole checkpoint and says which and why, or fails
with one line naming what is damaged. Standard library only: the launcher's tests read it too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

INDEX = "checkpoint"  # TensorFlow's index file
_LATEST = re.compile(r'^model_checkpoint_path:\s*"([^"]*)"', re.M)
_SHARD = re.compile(r"\.data-(\d+)-of-(\d+)$")


class CheckpointDamaged(RuntimeError):
    """No whole checkpoint to resume from where the run's checkpoints should be."""


@dataclass(frozen=True)
class ResumePoint:
    """Where a resume starts: ``path`` (a checkpoint prefix; None: at step 0) and, when the
    index could not be trusted, ``damage``: what is damaged and which checkpoint is used."""

    path: Path | None
    damage: str = ""


def find(folder: Path, name: str = "ckpt") -> ResumePoint:
    """The checkpoint in ``folder`` (named ``<name>-<step>``) that a resume starts from.

    Raises CheckpointDamaged when checkpoints were written there but none is whole.
    """
    if not folder.is_dir():
        return ResumePoint(None)
    whole = _whole_steps(folder, name)
    written = any(folder.glob(f"{name}-*.index"))
    try:
        text = (folder / INDEX).read_text(errors="replace")
    except FileNotFoundError:
        if not written:
            return ResumePoint(None)  # a fresh run: nothing was ever saved here
        damage = f"{folder / INDEX} is missing"
    except OSError as exc:
        damage = f"{folder / INDEX} cannot be read ({exc.strerror})"
    else:
        named = _LATEST.search(text)
        if named is None:
            damage = f"{folder / INDEX} is garbled (it names no latest checkpoint)"
        else:
            latest = Path(named.group(1)).name
            step = latest.removeprefix(f"{name}-")
            if step.isdigit() and int(step) in whole:
                return ResumePoint(folder / latest)
            damage = f"{folder / INDEX} names {latest}, whose files are missing or incomplete"
    if not whole:
        raise CheckpointDamaged(f"cannot resume: {damage}, and no other checkpoint there is whole")
    step = max(whole)
    used = f"resuming from {name}-{step}, the newest whole checkpoint"
    return ResumePoint(folder / f"{name}-{step}", f"{damage}; {used}")


def _whole_steps(folder: Path, name: str) -> set[int]:
    """The steps of the checkpoints in ``folder`` whose index file and every data shard exist."""
    steps = set()
    for index in folder.glob(f"{name}-*.index"):
        step = index.name.removeprefix(f"{name}-").removesuffix(".index")
        if not step.isdigit():
            continue
        shards = [_SHARD.search(p.name) for p in folder.glob(f"{name}-{step}.data-*")]
        found = {(int(m.group(1)), int(m.group(2))) for m in shards if m}
        counts = {total for _, total in found}
        if len(counts) == 1 and {k for k, _ in found} == set(range(counts.pop())):
            steps.add(int(step))
    return steps
