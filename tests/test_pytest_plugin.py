"""The pytest plugin (`tf_cluster` fixture and marker), run the way a user runs it: pytester runs
user test files in a pytest subprocess that loads the plugin through its `pytest11` entry point,
on real TensorFlow tasks (the docs' example; the fixture's failures, kills and restarts on tasks
that import no TensorFlow). After each, no process of any run those tests made is left."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import REPO, processes_of_run

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.integration


def docs_block(page: str) -> str:
    """The first ```python block of the docs page ``page`` (docs/)."""
    text = (REPO / "docs" / page).read_text()
    return re.search(r"```python\n(.*?)```", text, re.S)[1]


def runs_under(folder: Path) -> list[Path]:
    """The run dirs of the tf_cluster runs under ``folder``, oldest first (by run.json's
    started_at: run ids name their start to the second, and quick runs share a second)."""
    records = folder.glob("**/tf_cluster/*/run.json")
    return [
        p.parent for p in sorted(records, key=lambda p: json.loads(p.read_text())["started_at"])
    ]


def assert_nothing_left(runs: list[Path]) -> None:
    for run_dir in runs:
        record = json.loads((run_dir / "run.json").read_text())
        assert processes_of_run(record["run_id"]) == [], run_dir
        assert record["state"] != "running", run_dir


def test_the_docs_example_passes_and_leaves_nothing(pytester: pytest.Pytester):
    pytester.makepyfile(test_user=docs_block("pytest-plugin.md"))
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    runs = runs_under(pytester.path)
    assert len(runs) == 2  # 2 workers, then 1
    assert [json.loads((r / "run.json").read_text())["state"] for r in runs] == ["succeeded"] * 2
    assert_nothing_left(runs)


USER_TESTS = """
import time

import pytest

import distlaunch


def join_then(what):  # no TensorFlow: what these tests show is the fixture's
    import os

    task = int(os.environ["DISTLAUNCH_INDEX"])
    print("joined", flush=True)
    if what == "raise" and task == 1:
        raise ValueError("bad batch shape (7, 3)")
    if what == "sleep":
        time.sleep(600)
    return task


@pytest.mark.tf_cluster(workers=2)
def test_task_raises(tf_cluster):
    tf_cluster.run(join_then, "raise")


@pytest.mark.tf_cluster(workers=2)
def test_fails_while_its_call_still_runs(tf_cluster):
    tf_cluster.start(join_then, "sleep")
    tf_cluster.wait_for_output("worker-1", "joined")
    assert tf_cluster.tf_config("worker:1")["task"] == {"type": "worker", "index": 1}
    assert False, "the user's own assertion"


@pytest.mark.tf_cluster(workers=2)
def test_kill_a_task(tf_cluster):
    call = tf_cluster.start(join_then, "sleep")
    tf_cluster.wait_for_output("worker-0", "joined")
    tf_cluster.kill("worker-0")
    with pytest.raises(distlaunch.TaskError, match="worker-0 signal SIGKILL"):
        call.result()
    assert "joined" in tf_cluster.output("worker-0")


@pytest.mark.tf_cluster(workers=2)
def test_restart_a_task(tf_cluster):
    call = tf_cluster.start(join_then, "sleep")
    tf_cluster.wait_for_output("worker-1", "joined")
    assert tf_cluster.restart("worker:1") == "worker-1"
    # An MWMS task restarts with its gang: both come back as attempt 1 and join again.
    while not all(r["attempt"] == 1 for r in call.run.tasks):
        time.sleep(0.05)
    tf_cluster.wait_for_output("worker-1", "joined")
    assert call.run.state == "running"
"""


def test_failing_user_tests_name_their_run_dirs_and_leave_nothing(pytester: pytest.Pytester):
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2)
    out = result.stdout.str()
    runs = runs_under(pytester.path)
    assert len(runs) == 4
    # The task's exception failed the test as itself, and the report names the run dir.
    assert "ValueError: bad batch shape (7, 3)" in out
    assert "distlaunch.run: raised in task worker-1 of run" in out
    assert re.search(r"-+ distlaunch tf_cluster -+\nrun dirs:\n" + re.escape(str(runs[0])), out)
    assert "AssertionError: the user's own assertion" in out
    # The call left running by the failed test was stopped at its end, by the fixture.
    states = [json.loads((r / "run.json").read_text())["state"] for r in runs]
    # (the restarted run was stopped at its test's end)
    assert states == ["failed", "interrupted", "failed", "interrupted"]
    assert "tf_cluster: " not in out  # the fixture found nothing left to clean up
    assert_nothing_left(runs)


KWARGS_TEST = """
import pytest


def options(workers=1, env=None, strategy=None, timeout_s=None, spec=None, quiet=None, pool=None):
    return [workers, env, strategy, timeout_s, spec, quiet, pool]


@pytest.mark.tf_cluster(workers=2)
def test_kwargs(tf_cluster):
    given = [5, {"A": "b"}, "mine", 3, "spec.json", "loud", "deep"]
    names = ["workers", "env", "strategy", "timeout_s", "spec", "quiet", "pool"]
    values = tf_cluster.run(options, **dict(zip(names, given)))
    assert values == {"worker-0": given, "worker-1": given}
    assert tf_cluster.start(options, workers=7).result()["worker-1"][0] == 7
"""


def test_the_functions_keyword_arguments_are_never_taken_for_launch_options(
    pytester: pytest.Pytester,
):
    pytester.makepyfile(test_user=KWARGS_TEST)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    runs = runs_under(pytester.path)
    assert len(runs) == 2  # each a cluster of the marker's 2 workers
    assert all(len(json.loads((r / "run.json").read_text())["tasks"]) == 2 for r in runs)
    assert_nothing_left(runs)
