"""Helpers shared by the benchmarks: timing commands side by side and summarising them."""

from __future__ import annotations

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
