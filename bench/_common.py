"""Helpers shared by the benchmarks: timing commands side by side and summarising them."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DISTLAUNCH = [sys.executable, "-m", "distlaunch.launcher"]


def timed(argv: list[str], **kw) -> float:
    """Run ``argv`` to completion and return its wall time in seconds; fail loudly on error."""
    start = time.perf_counter()
    subprocess.run(argv, check=True, **kw)
    return time.perf_counter() - start


def median(values: list[float]) -> float:
    """The median, which shrugs off one noisy round on a shared machine."""
    return statistics.median(values)


def bytecode_on() -> None:
    """Run the launcher with Python's bytecode cache, as an installed distlaunch has it, and fill
    the cache now: where PYTHONDONTWRITEBYTECODE is set (this development machine sets it), every
    start would compile the launcher's modules anew, a cost no user pays."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(REPO / "launcher"), str(REPO / "worker")],
        check=True,
    )
