"""The API's types reach users' type checkers: distlaunch ships py.typed (PEP 561) and a real
`SpecInput` type alias, so mypy and pyright, run on a user's file against distlaunch installed
from its wheel, report each wrong call (issue 39, item 15)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

for _checker in ("mypy", "pyright"):
    if importlib.util.find_spec(_checker) is None:
        pytest.skip(f"{_checker} is not installed (the dev extras)", allow_module_level=True)

USER = """\
import distlaunch

distlaunch.launch(42)
distlaunch.run(len, "abc", workers="two")
result: int = distlaunch.up("spec.json")
values = distlaunch.run(len, "abc", workers=2)
spec: distlaunch.SpecInput = {"tasks": {"worker": {"count": 2}}}
run = distlaunch.launch(spec, console=None)
state: str = run.state
"""
WRONG_LINES = {3, 4, 5}  # the calls and the assignment above that a checker must report


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment with distlaunch installed from its wheel, as a user has it (an
    editable install's import hook is invisible to type checkers); its python."""
    folder = tmp_path_factory.mktemp("typed")
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", folder, REPO],
        check=True,
        capture_output=True,
    )
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", folder / "venv"], check=True)
    python = folder / "venv" / "bin" / "python"
    (wheel,) = folder.glob("*.whl")
    subprocess.run(
        [*pip, "--python", python, "install", "-q", "--no-deps", wheel],
        check=True,
        capture_output=True,
    )
    (folder / "user.py").write_text(USER)
    return python


def _lines(output: str, pattern: str) -> set[int]:
    return {int(n) for n in re.findall(pattern, output)}


def test_mypy_reports_each_wrong_call(installed: Path):
    user = installed.parent.parent.parent / "user.py"
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--python-executable", installed, "--no-incremental", user],
        capture_output=True,
        text=True,
    ).stdout
    assert _lines(out, r"user\.py:(\d+): error") == WRONG_LINES, out


def test_pyright_reports_each_wrong_call(installed: Path):
    user = installed.parent.parent.parent / "user.py"
    out = subprocess.run(
        [sys.executable, "-m", "pyright", "--pythonpath", installed, user],
        capture_output=True,
        text=True,
    ).stdout
    assert _lines(out, r"user\.py:(\d+):\d+ - error") == WRONG_LINES, out
