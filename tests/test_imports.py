"""Every module of launcher/ and worker/ imports: the quick lane (`pytest -m quick`) reaches each
one, those only a TensorFlow task runs (worker/train.py, worker/ps.py...) included, without
starting a cluster. One fresh interpreter imports them all, so no test inherits TensorFlow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

REPO = Path(__file__).resolve().parent.parent
# Folders and the import names pyproject.toml maps them to (the first that holds a file wins).
PACKAGES = (
    ("launcher/root", "distlaunch"),
    ("launcher/host", "distlaunch.host"),
    ("launcher", "distlaunch.launcher"),
    ("worker", "distlaunch.worker"),
)

IMPORT_ALL = """
import importlib, json, sys
failed = {}
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except BaseException as exc:  # a module that exits or raises on import: name it
        failed[name] = repr(exc)[:300]
print(json.dumps(failed))
"""


def module_names() -> list[str]:
    """The import name of every module file of the packages (`__main__` runs a command: left
    out)."""
    names = {}
    for folder, package in PACKAGES:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO)
            owner = next(f for f, _ in PACKAGES if rel.is_relative_to(f))
            if owner != folder or path.stem == "__main__":
                continue
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            names[str(rel)] = ".".join((package, *parts))
    return sorted(names.values())


def test_every_module_of_launcher_and_worker_imports() -> None:
    names = module_names()
    assert len(names) > 100 and "distlaunch.worker.train" in names
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, json.dumps(names)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {}
