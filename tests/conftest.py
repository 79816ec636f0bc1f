"""Shared test helpers: writing specs, running the real `distlaunch` CLI, finding stray processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent


def write_spec(folder: Path, name: str = "spec.json", **fields) -> Path:
    """Write a spec (fields merged over a 2-worker MWMS default) and return its path."""
    spec = {
        "name": "t",
        "strategy": "multi_worker_mirrored",
        "program": {"script": "task.py"},
        "tasks": {"worker": {"count": 2}},
        "shared_dir": "runs",
        "timeouts": {"grace_s": 2, "startup_s": 120},
    }
    spec.update(fields)
    path = folder / name
    path.write_text(json.dumps(spec, indent=2))
    return path


def distlaunch(*args: str, cwd: Path | None = None, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "distlaunch.launcher", *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout, **kw,
    )


def processes_of_run(run_id: str) -> list[psutil.Process]:
    """Every live process whose environment names this run (tasks and anything they forked)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid == os.getpid():
                continue
            if proc.environ().get("DISTLAUNCH_RUN_ID") == run_id and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def only_run_dir(shared: Path) -> Path:
    """The single run directory under ``shared``."""
    runs = [p for p in shared.iterdir() if (p / "run.json").is_file()]
    assert len(runs) == 1, runs
    return runs[0]


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    """A temp dir to hold a spec, its script and its runs."""
    return tmp_path
