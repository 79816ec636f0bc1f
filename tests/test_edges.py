"""Hostile input and hostile surroundings end cleanly: one line and exit 2 for bad input, and a
run that finishes whatever its terminal, its neighbours or a second launcher do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from conftest import distlaunch, run_record, wait_for, wait_for_run_dir, write_spec

TASK = "print('hi')\n"


def _spec(tmp: Path, **fields) -> Path:
    (tmp / "task.py").write_text(TASK)
    return write_spec(tmp, tasks={"worker": {"count": 1}}, **fields)


def _assert_one_line_exit_2(done, *expected: str) -> str:
    """The command failed as bad input should: exit 2, one line on stderr, no traceback."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[
        -2000:
    ]
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
    (
        "nested 100k deep",
        BASE + '"tasks": {"worker": ' + "[" * 100_000 + "]" * 100_000 + "}}",
        "nested",
    ),
    (
        "5000-digit integer",
        BASE + '"tasks": {"worker": {"count": ' + "7" * 5000 + "}}}",
        "$.tasks.worker.count",
    ),
    (
        "Infinity grace",
        BASE + '"tasks": {"worker": {}}, "timeouts": {"grace_s": Infinity}}',
        "$.timeouts.grace_s",
    ),
    (
        "1e400 grace",
        BASE + '"tasks": {"worker": {}}, "timeouts": {"grace_s": 1e400}}',
        "$.timeouts.grace_s",
    ),
    (
        "NaN backoff",
        BASE + '"tasks": {"worker": {}}, "restart": {"backoff": {"max_s": NaN}}}',
        "$.restart.backoff.max_s",
    ),
    ("50,000 tasks", BASE + '"tasks": {"worker": {"count": 50000}}}', "4096"),
    (
        "5,000 listed tasks",
        BASE + '"tasks": {"worker": [' + ",".join(["{}"] * 5000) + "]}}",
        "4096",
    ),
    (
        "huge gpu count",
        BASE + '"tasks": {"worker": {"gpus": 100000000000}}}',
        "integer 0-1024",
    ),
]


@pytest.mark.quick
@pytest.mark.parametrize("case,text,expected", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_spec_values_are_one_line_and_exit_2(tmp, case, text, expected):
    spec = _raw_spec(tmp, text)
    for command in ("validate", "plan"):
        line = _assert_one_line_exit_2(distlaunch(command, str(spec), cwd=tmp), expected)
        assert len(line) < 400, line  # the value itself is not echoed whole


@pytest.mark.quick
def test_a_program_python_that_does_not_exist_is_a_spec_error(tmp):
    spec = _spec(tmp, program={"script": "task.py", "python": "/nonexistent/python3"})
    for command in ("validate", "up"):
        _assert_one_line_exit_2(distlaunch(command, str(spec), cwd=tmp), "$.program.python")
    assert not (tmp / "runs").exists()


@pytest.mark.quick
def test_a_shared_dir_under_a_regular_file_is_a_spec_error(tmp):
    (tmp / "blocker").write_text("a file, not a folder")
    spec = _spec(tmp, shared_dir="blocker/runs")
    for command in ("validate", "up"):
        _assert_one_line_exit_2(distlaunch(command, str(spec), cwd=tmp), "$.shared_dir", "blocker")


# ---------------------------------------------------------------- item 10: run ids and run dirs


@pytest.mark.quick
@pytest.mark.parametrize("run_id", ["../escaped", "", ".", "a/b", "-x"])
def test_a_run_id_that_is_not_a_folder_name_is_refused(tmp, run_id):
    spec = _spec(tmp)
    _assert_one_line_exit_2(distlaunch("up", str(spec), "--run-id", run_id, cwd=tmp), "--run-id")
    assert not (tmp / "escaped").exists() and not (tmp / "runs" / "run.json").exists()


@pytest.mark.quick
def test_an_existing_folder_is_never_reused_as_a_new_run_dir(tmp):
    spec = _spec(tmp)
    (tmp / "runs" / "mine").mkdir(parents=True, mode=0o755)
    _assert_one_line_exit_2(
        distlaunch("up", str(spec), "--run-id", "mine", cwd=tmp), "already exists"
    )
    assert list((tmp / "runs" / "mine").iterdir()) == []


def _finished_run(run_dir: Path, mode: int = 0o700) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(
        json.dumps({"run_id": run_dir.name, "name": "t", "state": "failed", "attempt": 0})
    )
    run_dir.chmod(mode)


def test_resume_refuses_a_symlinked_or_open_run_dir(tmp):
    spec = _spec(tmp)
    _finished_run(tmp / "elsewhere" / "real")
    (tmp / "runs").mkdir()
    (tmp / "runs" / "link").symlink_to(tmp / "elsewhere" / "real")
    _assert_one_line_exit_2(
        distlaunch("up", str(spec), "--run-id", "link", cwd=tmp), "symbolic link"
    )
    _finished_run(tmp / "runs" / "open", 0o755)
    _assert_one_line_exit_2(distlaunch("up", str(spec), "--run-id", "open", cwd=tmp), "0755")
    assert (
        not (tmp / "elsewhere" / "real" / "logs").exists()
        and not (tmp / "runs" / "open" / "logs").exists()
    )


# ---------------------------------------------------------------- item 4: one launcher per run dir

SLEEPER = "import time\ntime.sleep(600)\n"


def test_a_second_launcher_of_the_same_run_gets_one_line_and_exit_2(tmp, launch):
    (tmp / "task.py").write_text(SLEEPER)
    spec = write_spec(
        tmp, tasks={"worker": {"count": 1}}, timeouts={"grace_s": 1, "startup_s": 600}
    )
    first = launch(spec, "--run-id", "same")
    try:
        run_dir = wait_for_run_dir(tmp / "runs", first)
        wait_for(
            lambda: run_record(run_dir).get("tasks", {}).get("worker-0", {}).get("pid"),
            "worker-0 started",
            launcher=first,
        )
        # What run.json says while the first launcher has not written its own record yet (SSH
        # preflight, an image build): the previous attempt, ended. A second launcher must still
        # see that the run dir is taken.
        record = run_record(run_dir)
        (run_dir / "run.json").write_text(json.dumps({**record, "state": "failed"}))
        second = distlaunch("up", str(spec), "--run-id", "same", cwd=tmp, timeout=120)
        _assert_one_line_exit_2(second, "in use by another launcher")
        assert not (run_dir / "logs" / "attempt-1").exists()
        assert first.poll() is None
    finally:
        distlaunch("down", "same", "--shared-dir", str(tmp / "runs"), "--grace", "1")
        first.wait(timeout=60)


# ---------------------------------------------------------------- item 5: down stops its own run only


def test_down_leaves_another_projects_run_with_the_same_id_alone(tmp, launch):
    launchers, run_dirs = [], []
    try:
        for project in ("a", "b"):
            (tmp / project).mkdir()
            (tmp / project / "task.py").write_text(SLEEPER)
            spec = write_spec(
                tmp / project,
                tasks={"worker": {"count": 1}},
                timeouts={"grace_s": 1, "startup_s": 600},
            )
            launcher = launch(spec, "--run-id", "same")
            launchers.append(launcher)
            run_dir = wait_for_run_dir(tmp / project / "runs", launcher)
            run_dirs.append(run_dir)
            wait_for(
                lambda run_dir=run_dir: (
                    run_record(run_dir).get("tasks", {}).get("worker-0", {}).get("pid")
                ),
                "worker-0 started",
                launcher=launcher,
            )
        other_task = psutil.Process(run_record(run_dirs[1])["tasks"]["worker-0"]["pid"])
        done = distlaunch("down", "same", "--shared-dir", str(tmp / "a" / "runs"), "--grace", "1")
        assert done.returncode == 0, done.stderr
        launchers[0].wait(timeout=60)
        assert run_record(run_dirs[0])["state"] == "interrupted"
        assert launchers[1].poll() is None and other_task.is_running(), (
            "down stopped the other project's run"
        )
        assert run_record(run_dirs[1])["state"] == "running"
    finally:
        for project, launcher in zip(("a", "b"), launchers):
            distlaunch(
                "down",
                "same",
                "--shared-dir",
                str(tmp / project / "runs"),
                "--grace",
                "1",
            )
            launcher.wait(timeout=60)


# ---------------------------------------------------------------- item 14: secrets never shown
# (plan, up, status, run.json and events.jsonl: test_injection.py's masking test)


@pytest.mark.quick
@pytest.mark.parametrize(
    "env",
    [
        {"DB_PASS": 987654321},
        "DB_PASS=hunter2-987654321",
        {"PLAIN": ["hunter2-987654321"]},
    ],
)
def test_a_spec_error_in_env_never_echoes_the_value(tmp, env):
    spec = _spec(tmp, program={"script": "task.py", "env": env})
    line = _assert_one_line_exit_2(distlaunch("validate", str(spec), cwd=tmp), "$.program.env")
    assert "987654321" not in line


# ---------------------------------------------------------------- item 6: a stdout nobody reads

# 2 MB of numbered lines (far more than a pipe holds), then: attempt 0 fails, attempt 1 succeeds.
NOISY = """
import os, sys
out = sys.stdout
for i in range(20000):
    out.write(f"line {i:05d} " + "x" * 88 + "\\n")
out.flush()
sys.exit(1 if os.environ["DISTLAUNCH_ATTEMPT"] == "0" else 0)
"""


@pytest.mark.quick
@pytest.mark.parametrize("reader", ["never reads", "closed"])
def test_a_stdout_nobody_reads_never_holds_the_run(tmp, reader):
    (tmp / "task.py").write_text(NOISY)
    spec = write_spec(
        tmp,
        tasks={"worker": {"count": 1}},
        restart={
            "policy": "on-failure",
            "max_restarts": 1,
            "backoff": {"initial_s": 0},
        },
    )
    read_end, write_end = os.pipe()
    if reader == "closed":
        os.close(read_end)  # `| head -3` that has exited: every write fails with EPIPE
    with open(tmp / "stderr.txt", "w") as err:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "distlaunch.launcher", "up", str(spec)],
            cwd=tmp,
            stdout=write_end,
            stderr=err,
        )
    os.close(write_end)
    try:
        # Not a timing assertion: a launcher stuck on its stdout would never exit.
        code = launcher.wait(timeout=300)
    finally:
        launcher.kill()
        if reader != "closed":
            os.close(read_end)
    stderr = (tmp / "stderr.txt").read_text()
    assert code == 0, stderr[-3000:]
    assert "Traceback" not in stderr
    run_dir = next((tmp / "runs").iterdir())
    assert run_record(run_dir)["state"] == "succeeded"
    for attempt in (0, 1):
        lines = (run_dir / "logs" / f"attempt-{attempt}" / "worker-0.log").read_text().splitlines()
        assert [line[5:10] for line in lines] == [
            f"{i:05d}" for i in range(20000)
        ]  # the logs are complete


# ---------------------------------------------------------------- item 15: progress bars

# tqdm-style progress (each state starts with a carriage return, no newline) and 4 MB on one line.
PROGRESS = """
import sys
for i in range(200001):
    sys.stdout.write(f"\\rprogress {i:06d}/200000 " + "#" * 80)
sys.stdout.write("\\n" + "y" * 4_000_000 + "\\ndone\\n")
"""


@pytest.mark.quick
def test_carriage_return_progress_is_echoed_as_its_latest_state(tmp):
    (tmp / "task.py").write_text(PROGRESS)
    spec = write_spec(tmp, tasks={"worker": {"count": 1}})
    done = distlaunch("up", str(spec), cwd=tmp)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "worker-0 | done"
    shown = [line for line in lines if "progress" in line]
    assert shown and [line for line in shown if not line.startswith("worker-0 | progress ")] == []
    assert shown[-1].startswith("worker-0 | progress 200000/200000")
    # States, not every update: how many states show depends on how often the launcher reads
    # the log (a loaded machine reads less often), but never near one line per update.
    assert len(shown) < 200000 // 20
    assert all(
        len(line) <= 64 * 1024 + 20 for line in lines
    )  # a huge line is echoed in bounded pieces
    run_dir = next((tmp / "runs").iterdir())
    assert (
        run_dir / "logs" / "attempt-0" / "worker-0.log"
    ).stat().st_size > 20_000_000  # the log keeps all
