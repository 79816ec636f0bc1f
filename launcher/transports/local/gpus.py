"""The GPUs of this machine, and the check that a run's local tasks ask only for GPUs it has.

Without the check a task given an index this machine lacks gets a CUDA_VISIBLE_DEVICES naming a
device that does not exist: CUDA then shows it no GPU at all, and TensorFlow trains on the CPU
without a word. So `up` refuses such a spec as bad input, before anything starts; `plan` does not
(a plan is written on a laptop for the cluster).

The count is read from the NVIDIA driver's /proc entries (one folder per GPU, no process started,
no CUDA context made), else from `nvidia-smi -L` where /proc lacks them (some container runtimes).
The launcher's own CUDA_VISIBLE_DEVICES, when set, is what it may use: a task's indices count
within it (plan._cuda_visible), so its length is the count.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from distlaunch.launcher.core.backends import TaskTransport
from distlaunch.launcher.core.errors import SpecError
from distlaunch.launcher.plan.placement import Placements
from distlaunch.launcher.spec.model import LoadedSpec, task_json_path

DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")


def count(visible: str | None) -> int:
    """How many GPUs this launcher may give its local tasks; ``visible`` is its own
    CUDA_VISIBLE_DEVICES (None: not set)."""
    if visible is not None:
        return len([g for g in visible.split(",") if g.strip()])
    if DRIVER_GPUS.is_dir():
        return sum(1 for _ in DRIVER_GPUS.iterdir())
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in listed.splitlines() if line.startswith("GPU "))


def check(loaded: LoadedSpec, placed: Placements, visible: str | None) -> None:
    """Raise SpecError, naming the first task's `gpus`, when a task on this machine is given a
    GPU index it does not have (asked by index, or picked for a count: tasks never share one)."""
    local = [r for r in placed.rows if r.transport == TaskTransport.LOCAL and r.gpus]
    if not local:
        return
    have = count(visible)
    for row in local:
        missing = [g for g in row.gpus if g >= have]
        if not missing:
            continue
        if have == 0:
            found = (
                f"CUDA_VISIBLE_DEVICES={visible!r} leaves the launcher none"
                if visible is not None
                else "this machine has none (no NVIDIA driver found)"
            )
            message = f"asks for a GPU, but {found}; expected no `gpus` to run on the CPU"
        else:
            within = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
            indices = "index 0" if have == 1 else f"indices 0-{have - 1}"
            message = (
                f"gives {row.role}:{row.index} GPU {missing[0]}, but this machine has "
                f"{have}{within} ({indices}); tasks here never share a GPU, so "
                f"expected at most {have} across its tasks"
            )
        where = task_json_path(loaded.raw, row.role, row.index, "gpus")
        raise SpecError(str(loaded.file), where, message)
