"""timeouts.startup_s: null is "no deadline" (what `distlaunch.run`'s own cluster uses)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from distlaunch.launcher.cli import cli
from distlaunch.launcher.core.errors import SpecError
from distlaunch.launcher.spec.model import load_spec

SPEC = {
    "name": "nodeadline",
    "strategy": "multi_worker_mirrored",
    "program": {"script": "task.py"},
    "tasks": {"worker": {"count": 1}},
}


def _spec(tmp_path: Path, startup_s: object) -> Path:
    (tmp_path / "task.py").write_text("")
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({**SPEC, "timeouts": {"startup_s": startup_s}}))
    return path


@pytest.mark.quick
def test_null_is_accepted_and_read_as_no_deadline(tmp_path):
    path = _spec(tmp_path, None)
    result = CliRunner().invoke(cli, ["validate", str(path)])
    assert result.exit_code == 0, result.output
    assert load_spec(path).spec.timeouts.startup_s is None
    assert load_spec(_spec(tmp_path, 12)).spec.timeouts.startup_s == 12.0


@pytest.mark.quick
@pytest.mark.parametrize("value", ["never", 0, -1, True])
def test_what_is_neither_a_positive_number_nor_null_is_refused_in_one_line(tmp_path, value):
    result = CliRunner().invoke(cli, ["validate", str(_spec(tmp_path, value))])
    # The typed error the CLI's entry point turns into exit code 2, its line naming the key.
    assert isinstance(result.exception, SpecError), result.output
    line = str(result.exception)
    assert "$.timeouts.startup_s: expected a number" in line and "\n" not in line
