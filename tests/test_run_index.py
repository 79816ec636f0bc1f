"""`up` finds this spec's latest run by the run ids alone: with thousands of runs kept it reads
one run.json, not all of them (issue 50), and still picks the run the full scan picked.

What a process opens is seen by a Python audit hook (every `open` and `os.open` raises the
"open" event) in a real `distlaunch up`: no timing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from conftest import write_spec
from distlaunch.launcher.record.state import latest_unfinished

pytestmark = pytest.mark.quick

KEPT = 5000
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _run(shared: Path, name: str, second: int, state: str, suffix: str = "0a0b") -> Path:
    """A kept run of spec ``name`` started ``second`` s after T0, with the id `up` gives it."""
    at = T0 + timedelta(seconds=second)
    run_dir = shared / f"{name}-{at:%Y%m%d-%H%M%S}-{suffix}"
    run_dir.mkdir(parents=True)
    record = {"run_id": run_dir.name, "name": name, "state": state, "started_at": at.timestamp()}
    (run_dir / "run.json").write_text(json.dumps(record))
    return run_dir


def _keep_runs(shared: Path) -> Path:
    """KEPT runs: spec t's, all succeeded but the newest, which failed; newer runs of spec
    "t-big" (whose ids start with "t-") that did not finish either. Returns t's newest."""
    for i in range(KEPT - 3):
        _run(shared, "t", i, "succeeded")
    unfinished = _run(shared, "t", KEPT, "failed")
    _run(shared, "t-big", KEPT + 10, "failed")
    _run(shared, "t-big", KEPT + 11, "failed")
    return unfinished


# Runs `distlaunch` with an audit hook that writes every run.json the launcher opens to OPENED.
AUDITED_CLI = """
import os, runpy, sys
out = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, os.PathLike)):
        path = os.fspath(args[0])
        if path.endswith("run.json"):
            os.write(out, (path + "\\n").encode())
sys.addaudithook(hook)
sys.argv = ["distlaunch", *sys.argv[2:]]
runpy.run_module("distlaunch.launcher", run_name="__main__")
"""


def test_up_with_5000_runs_kept_names_the_unfinished_one_and_opens_no_other_run_json(
    tmp: Path,
) -> None:
    shared = tmp / "runs"
    unfinished = _keep_runs(shared)
    # A newer run dir of t that a launcher is creating right now: no run.json yet.
    creating = shared / f"t-{T0 + timedelta(seconds=KEPT + 20):%Y%m%d-%H%M%S}-ffff"
    creating.mkdir()
    (tmp / "task.py").write_text("print('done')\n")
    spec = write_spec(tmp, tasks={"worker": {"count": 1}}, isolation="off")
    opened_file = tmp / "opened.txt"
    kept = set(shared.iterdir())
    result = subprocess.run(
        [sys.executable, "-c", AUDITED_CLI, str(opened_file), "up", str(spec)],
        cwd=tmp,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert f"run {unfinished.name} did not finish: starting a new run" in result.stderr
    new_runs = set(shared.iterdir()) - kept
    assert len(new_runs) == 1, sorted(p.name for p in new_runs)  # the run this `up` started
    (new_run,) = new_runs
    opened = {Path(p).resolve() for p in opened_file.read_text().split("\n") if p}
    earlier = {p for p in opened if p.parent != new_run.resolve()}
    # The run being created is looked into (no run.json: passed over), then the unfinished one;
    # none of the other 4,999 run.json files is opened.
    assert earlier == {(creating / "run.json").resolve(), (unfinished / "run.json").resolve()}


def test_the_latest_run_is_found_by_id_and_its_record_decides(tmp: Path) -> None:
    shared = tmp / "runs"
    unfinished = _keep_runs(shared)
    assert latest_unfinished(shared, "t") == unfinished
    assert latest_unfinished(shared, "t-big").name.startswith("t-big-")
    assert latest_unfinished(shared, "nothing") is None
    assert latest_unfinished(tmp / "no-such-dir", "t") is None
    # A newer run of t that succeeded: the latest run finished, nothing to offer.
    newest = _run(shared, "t", KEPT + 30, "succeeded")
    assert latest_unfinished(shared, "t") is None
    # Deleted by hand: the run before it decides again.
    shutil.rmtree(newest)
    assert latest_unfinished(shared, "t") == unfinished


def test_runs_started_within_one_second_are_ordered_by_their_records(tmp: Path) -> None:
    shared = tmp / "runs"
    _run(shared, "t", 0, "succeeded")
    first = _run(shared, "t", 10, "failed", suffix="ffff")
    second = _run(shared, "t", 10, "succeeded", suffix="0000")
    # Same second: "ffff" sorts after "0000" but started first.
    record = json.loads((second / "run.json").read_text())
    record["started_at"] += 0.5
    (second / "run.json").write_text(json.dumps(record))
    assert latest_unfinished(shared, "t") is None
    record["state"] = "failed"
    (second / "run.json").write_text(json.dumps(record))
    assert latest_unfinished(shared, "t") == second
    # A record of another spec in a dir named like t's (copied by hand) is not t's run.
    record["name"] = "other"
    (second / "run.json").write_text(json.dumps(record))
    assert latest_unfinished(shared, "t") == first


def test_a_damaged_newest_record_is_passed_over(tmp: Path) -> None:
    shared = tmp / "runs"
    unfinished = _run(shared, "t", 0, "failed")
    damaged = _run(shared, "t", 5, "succeeded")
    (damaged / "run.json").write_text("{ not json")
    assert latest_unfinished(shared, "t") == unfinished
