"""This machine's GPUs, and the check that a run's local tasks ask only for GPUs it has
(`plan.gpu_fit`). `up` refuses such a spec as bad input before anything starts; `plan` does not
(a plan is written on a laptop for the cluster).

The count is read from the NVIDIA driver's /proc entries (one folder per GPU: no process started,
no CUDA context made), else from `nvidia-smi -L` where /proc lacks them (some container
runtimes). The launcher's own CUDA_VISIBLE_DEVICES, when set, is what it may use: a task's
indices count within it (plan._cuda_visible), so its length is the count.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from distlaunch.launcher.core.backends import TaskTransport
from distlaunch.launcher.core.errors import SpecError
from distlaunch.launcher.plan import gpu_fit
from distlaunch.launcher.plan.placement import Placements
from distlaunch.launcher.spec.model import LoadedSpec, task_json_path

DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")


def count(visible: str | None) -> int:
    """How many GPUs this launcher may give its local tasks; ``visible`` is its own
    CUDA_VISIBLE_DEVICES (None: not set)."""
    if visible is not None:
        return len([g for g in visible.split(",") if g.strip()])
    if DRIVER_GPUS.is_dir():
        return len(list(DRIVER_GPUS.iterdir()))
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in listed.splitlines() if line.startswith("GPU "))


def check(loaded: LoadedSpec, placed: Placements, visible: str | None) -> None:
    """Raise SpecError, naming the task's `gpus`, when a task on this machine is given a GPU
    index it does not have (asked by index, or picked for a count: tasks never share one)."""
    local = [r for r in placed.rows if r.transport == TaskTransport.LOCAL and r.gpus]
    if not local:
        return
    have = count(visible)
    row = gpu_fit.misfit(local, have)
    if row is None:
        return
    if visible is not None:
        machine = f"this machine (CUDA_VISIBLE_DEVICES={visible})"
        none = f"CUDA_VISIBLE_DEVICES={visible!r} leaves the launcher none"
    else:
        machine, none = "this machine", "this machine has none (no NVIDIA driver found)"
    where = task_json_path(loaded.raw, row.role, row.index, "gpus")
    raise SpecError(loaded.shown, where, gpu_fit.problem(row, have, machine, none))
