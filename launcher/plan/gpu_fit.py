"""Whether a machine's GPUs fit the tasks placed on it: a task given an index the machine lacks
gets a CUDA_VISIBLE_DEVICES naming no device, and CUDA then shows it no GPU at all (TensorFlow
trains on the CPU without a word). The backends count the GPUs (this machine's, an SSH host's
probe) and turn what is found here into their error.

Pure: nothing here touches a machine.
"""

from __future__ import annotations

from collections.abc import Iterable

from distlaunch.launcher.plan.placement import Placement


def misfit(rows: Iterable[Placement], have: int) -> Placement | None:
    """The first of ``rows`` (tasks of one machine) given a GPU index past the ``have`` GPUs
    there; None when they all fit."""
    return next((r for r in rows if any(g >= have for g in r.gpus)), None)


def problem(row: Placement, have: int, machine: str, none: str) -> str:
    """What is wrong with ``row``'s GPUs on ``machine`` ("this machine", "the host"), which has
    ``have`` of them; ``none`` says why it has none."""
    if have == 0:
        return f"asks for a GPU, but {none}; expected no `gpus` to run on the CPU"
    gpu = next(g for g in row.gpus if g >= have)
    indices = "index 0" if have == 1 else f"indices 0-{have - 1}"
    return (
        f"gives {row.role}:{row.index} GPU {gpu}, but {machine} has {have} ({indices}); tasks "
        f"there never share a GPU, so expected at most {have} across its tasks"
    )
