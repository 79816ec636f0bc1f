"""Hostile input and hostile surroundings end cleanly: one line and exit 2 for bad input, and a
run that finishes whatever its terminal, its neighbours or a second launcher do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import distlaunch, write_spec

TASK = "print('hi')\n"


def _spec(tmp: Path, **fields) -> Path:
    (tmp / "task.py").write_text(TASK)
    return write_spec(tmp, tasks={"worker": {"count": 1}}, **fields)


def _assert_one_line_exit_2(done, *expected: str) -> str:
    """The command failed as bad input should: exit 2, one line on stderr, no traceback."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------- item 11: bad specs, one line


def _raw_spec(tmp: Path, text: str) -> Path:
    (tmp / "task.py").write_text(TASK)
    path = tmp / "spec.json"
    path.write_text(text)
    return path


BASE = '{"name": "t", "strategy": "multi_worker_mirrored", "program": {"script": "task.py"}, '


HOSTILE = [
    ("nested 100k deep", BASE + '"tasks": {"worker": ' + "[" * 100_000 + "]" * 100_000 + "}}", "nested"),
    ("5000-digit integer", BASE + '"tasks": {"worker": {"count": ' + "7" * 5000 + "}}}", "$.tasks.worker.count"),
    ("Infinity grace", BASE + '"tasks": {"worker": {}}, "timeouts": {"grace_s": Infinity}}', "$.timeouts.grace_s"),
    ("1e400 grace", BASE + '"tasks": {"worker": {}}, "timeouts": {"grace_s": 1e400}}', "$.timeouts.grace_s"),
    ("NaN backoff", BASE + '"tasks": {"worker": {}}, "restart": {"backoff": {"max_s": NaN}}}', "$.restart.backoff.max_s"),
    ("50,000 tasks", BASE + '"tasks": {"worker": {"count": 50000}}}', "4096"),
    ("5,000 listed tasks", BASE + '"tasks": {"worker": [' + ",".join(["{}"] * 5000) + "]}}", "4096"),
    ("huge gpu count", BASE + '"tasks": {"worker": {"gpus": 100000000000}}}', "integer 0-1024"),
]


@pytest.mark.parametrize("case,text,expected", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_spec_values_are_one_line_and_exit_2(tmp, case, text, expected):
    spec = _raw_spec(tmp, text)
    for command in ("validate", "plan"):
        line = _assert_one_line_exit_2(distlaunch(command, str(spec), cwd=tmp), expected)
        assert len(line) < 400, line  # the value itself is not echoed whole


def test_a_program_python_that_does_not_exist_is_a_spec_error(tmp):
    spec = _spec(tmp, program={"script": "task.py", "python": "/nonexistent/python3"})
    for command in ("validate", "up"):
        _assert_one_line_exit_2(distlaunch(command, str(spec), cwd=tmp), "$.program.python")
    assert not (tmp / "runs").exists()


def test_a_shared_dir_under_a_regular_file_is_a_spec_error(tmp):
    (tmp / "blocker").write_text("a file, not a folder")
    spec = _spec(tmp, shared_dir="blocker/runs")
    for command in ("validate", "up"):
        _assert_one_line_exit_2(distlaunch(command, str(spec), cwd=tmp), "$.shared_dir", "blocker")
