"""Tests of distlaunch.worker: task context, status and error files, and real training.

The training tests start real 2-worker MultiWorkerMirroredStrategy clusters on 127.0.0.1 as
subprocesses, with the launcher's DISTLAUNCH_* variables pointing into a temporary run dir.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import portpicker
import pytest

from distlaunch.worker import contract, runtime

EXAMPLE = ["-m", "distlaunch.worker.examples.mnist_mlp"]
# Each TensorFlow process needs 3-5 s just to import; a 2-worker example run about 20 s here.
CLUSTER_TIMEOUT_S = 150

# Every variable the launcher sets: the unit tests start from an environment without them.
LAUNCHER_VARIABLES = [
    contract.TF_CONFIG,
    contract.RUN_ID,
    contract.RUN_DIR,
    contract.ROLE,
    contract.INDEX,
    contract.ATTEMPT,
    contract.STRATEGY,
    contract.KERAS,
    contract.ERROR_FILE,
    contract.STATUS_FILE,
    contract.CHECKPOINT_DIR,
    contract.METRICS_FILE,
    "TF_USE_LEGACY_KERAS",
]


@dataclass(frozen=True)
class Task:
    """A finished task: its index, exit status and merged stdout/stderr."""

    index: int
    returncode: int
    output: str

    def final_loss(self) -> str:
        """Return the L of the task's ``final loss L`` line."""
        lines = [line for line in self.output.splitlines() if line.startswith("final loss ")]
        assert lines, f"worker-{self.index} printed no final loss:\n{self.output[-3000:]}"
        return lines[-1].removeprefix("final loss ")


def _task_env(
    run_dir: Path, index: int, attempt: int, keras: str, cluster: dict[str, list[str]] | None
) -> dict[str, str]:
    """Return the environment the launcher would give worker ``index`` (no TF_CONFIG without
    ``cluster``: a single process run by hand that still writes its files)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(
        {
            contract.RUN_ID: f"worker-runtime-{run_dir.name}",
            contract.RUN_DIR: str(run_dir),
            contract.ROLE: "worker",
            contract.INDEX: str(index),
            contract.ATTEMPT: str(attempt),
            contract.KERAS: keras,
            contract.ERROR_FILE: str(contract.error_path(run_dir, attempt, "worker", index)),
            contract.STATUS_FILE: str(contract.status_path(run_dir, "worker", index)),
            contract.CHECKPOINT_DIR: str(contract.checkpoint_dir(run_dir)),
            contract.METRICS_FILE: str(contract.metrics_path(run_dir, "worker", index)),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if cluster is not None:
        env[contract.TF_CONFIG] = json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": index}}
        )
        env[contract.STRATEGY] = contract.MWMS
    if keras == contract.TF_KERAS:
        env["TF_USE_LEGACY_KERAS"] = "1"
    return env


def run_tasks(
    run_dir: Path,
    argv: list[str],
    *,
    workers: int = 2,
    attempt: int = 0,
    keras: str = contract.KERAS3,
) -> list[Task]:
    """Run ``python argv`` as ``workers`` MWMS workers (or one process with no cluster when
    ``workers == 1``) until all exit, and return them. A failed worker's peers are killed at
    once: a lone MWMS worker would wait for it for an hour."""
    cluster = None
    if workers > 1:
        cluster = {"worker": [f"127.0.0.1:{portpicker.pick_unused_port()}" for _ in range(workers)]}
    logs = [contract.log_path(run_dir, attempt, "worker", i) for i in range(workers)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for index, log in enumerate(logs):
            log.parent.mkdir(parents=True, exist_ok=True)
            with log.open("wb") as out:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, *argv],
                        env=_task_env(run_dir, index, attempt, keras, cluster),
                        cwd=run_dir,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        while any(p.poll() is None for p in procs) and not any(p.returncode for p in procs):
            time.sleep(0.2)
    finally:
        for proc in procs:
            # SIGKILL: an MWMS worker blocked on its peers ignores SIGTERM.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return [Task(i, p.returncode, log.read_text()) for i, (p, log) in enumerate(zip(procs, logs))]


def assert_all_succeeded(tasks: list[Task]) -> None:
    """Fail with the logs' tails unless every task exited 0."""
    for task in tasks:
        assert task.returncode == 0, (
            f"worker-{task.index} exited {task.returncode}:\n{task.output[-3000:]}"
        )


def read_metrics(run_dir: Path, index: int = 0) -> list[dict]:
    """Return worker ``index``'s metrics list."""
    return json.loads(contract.metrics_path(run_dir, "worker", index).read_text())


# ---------------------------------------------------------------------------------------------
# Unit tests: no TensorFlow, no subprocess.


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """An environment without any of the launcher's variables."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _set_tf_config(env: pytest.MonkeyPatch, cluster: dict, role: str, index: int) -> None:
    tf_config = {"cluster": cluster, "task": {"type": role, "index": index}}
    env.setenv(contract.TF_CONFIG, json.dumps(tf_config))


@pytest.mark.quick
def test_context_without_launcher_is_a_single_chief(clean_env: pytest.MonkeyPatch) -> None:
    ctx = runtime.context()
    assert (ctx.role, ctx.index, ctx.attempt) == ("worker", 0, 0)
    assert ctx.is_chief and ctx.num_workers == 1
    assert ctx.strategy == runtime.DEFAULT_STRATEGY and ctx.keras == contract.KERAS3
    assert ctx.run_dir is None and ctx.checkpoint_dir is None


@pytest.mark.quick
def test_context_chief_rule(clean_env: pytest.MonkeyPatch) -> None:
    with_chief = {"chief": ["h:1"], "worker": ["h:2", "h:3"]}
    _set_tf_config(clean_env, with_chief, "worker", 0)
    assert not runtime.context().is_chief
    assert runtime.context().num_workers == 3  # the MWMS chief trains too
    _set_tf_config(clean_env, with_chief, "chief", 0)
    assert runtime.context().is_chief
    assert runtime.context().strategy == contract.MWMS

    _set_tf_config(clean_env, {"worker": ["h:2", "h:3"]}, "worker", 0)
    assert runtime.context().is_chief
    _set_tf_config(clean_env, {"worker": ["h:2", "h:3"]}, "worker", 1)
    assert not runtime.context().is_chief
    assert runtime.context().name == "worker-1"


@pytest.mark.quick
def test_context_reads_launcher_variables(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _set_tf_config(clean_env, {"chief": ["h:1"], "ps": ["h:2"], "worker": ["h:3"]}, "chief", 0)
    clean_env.setenv(contract.STRATEGY, contract.PSS)
    clean_env.setenv(contract.ATTEMPT, "2")
    clean_env.setenv(contract.RUN_ID, "r7")
    clean_env.setenv(contract.CHECKPOINT_DIR, str(tmp_path))
    clean_env.setenv("TF_USE_LEGACY_KERAS", "1")
    ctx = runtime.context()
    assert (ctx.attempt, ctx.run_id, ctx.checkpoint_dir) == (2, "r7", tmp_path)
    assert ctx.num_workers == 1  # under PSS the chief only coordinates
    assert ctx.keras == contract.TF_KERAS


@pytest.mark.quick
def test_report_writes_the_status_file_atomically(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    status_file = contract.status_path(tmp_path, "worker", 0)
    clean_env.setenv(contract.STATUS_FILE, str(status_file))
    clean_env.setenv(contract.ATTEMPT, "1")
    runtime.report(contract.STATE_READY, step=5)
    status = json.loads(status_file.read_text())
    assert status["state"] == "ready" and status["step"] == 5
    assert status["pid"] == os.getpid() and status["attempt"] == 1 and status["time"] > 0
    assert [p.name for p in status_file.parent.iterdir()] == [status_file.name]


@pytest.mark.quick
def test_checkpoint_dir_for_this_task(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert runtime.checkpoint_dir_for_this_task() is None
    clean_env.setenv(contract.CHECKPOINT_DIR, str(tmp_path))
    _set_tf_config(clean_env, {"worker": ["h:2", "h:3"]}, "worker", 0)
    assert runtime.checkpoint_dir_for_this_task() == tmp_path
    _set_tf_config(clean_env, {"worker": ["h:2", "h:3"]}, "worker", 1)
    assert runtime.checkpoint_dir_for_this_task() == tmp_path / ".tmp-worker-1"


# ---------------------------------------------------------------------------------------------
# Subprocess tests.


@pytest.mark.quick
def test_importing_contract_or_reporting_does_not_import_tensorflow(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "import distlaunch.worker.contract\n"
        "assert 'tensorflow' not in sys.modules, 'contract imported tensorflow'\n"
        "import distlaunch.worker as dw\n"
        "dw.context(); dw.report('starting')\n"
        "assert 'tensorflow' not in sys.modules, 'context/report imported tensorflow'\n"
    )
    env = _task_env(tmp_path, 0, 0, contract.KERAS3, None)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    status = json.loads(contract.status_path(tmp_path, "worker", 0).read_text())
    assert status["state"] == "starting"


@pytest.mark.quick
def test_uncaught_exception_writes_the_error_file(tmp_path: Path) -> None:
    env = _task_env(tmp_path, 1, 3, contract.KERAS3, None)
    script = tmp_path / "task.py"
    script.write_text("import distlaunch.worker\nraise ValueError('boom 42')\n")
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert "ValueError: boom 42" in result.stderr  # the original hook still prints it
    error = json.loads(contract.error_path(tmp_path, 3, "worker", 1).read_text())
    assert error["type"] == "ValueError" and error["message"] == "boom 42"
    assert "raise ValueError('boom 42')" in error["traceback"]
    assert (error["role"], error["index"], error["attempt"]) == ("worker", 1, 3)
    assert error["time"] > 0 and error["pid"] > 0


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Task]]:
    """The example trained with Keras 3 on 2 workers for 2 epochs of 20 steps."""
    run_dir = tmp_path_factory.mktemp("run")
    return run_dir, run_tasks(run_dir, [*EXAMPLE, "--epochs", "2", "--steps-per-epoch", "20"])


@pytest.mark.integration
@pytest.mark.timeout(CLUSTER_TIMEOUT_S)
def test_example_trains_keras3_on_two_workers(first_run: tuple[Path, list[Task]]) -> None:
    run_dir, tasks = first_run
    assert_all_succeeded(tasks)
    assert tasks[0].final_loss() == tasks[1].final_loss()
    assert "epoch 2/2 step 40 loss " in tasks[1].output

    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [20, 40]
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert [m["loss"] for m in read_metrics(run_dir, 1)] == [m["loss"] for m in metrics]
    for index in (0, 1):
        status = json.loads(contract.status_path(run_dir, "worker", index).read_text())
        assert (status["state"], status["step"]) == ("ready", 40)

    # Only the chief's checkpoints remain: no subdirectory left by worker 1's temporary copies.
    checkpoints = contract.checkpoint_dir(run_dir)
    assert all(p.is_file() for p in checkpoints.iterdir()), sorted(checkpoints.iterdir())
    names = {p.name for p in checkpoints.iterdir()}
    assert {"checkpoint", "ckpt-20.index", "ckpt-40.index"} <= names
    assert not (run_dir / "errors").exists()


@pytest.mark.integration
@pytest.mark.timeout(CLUSTER_TIMEOUT_S)
def test_rerun_resumes_from_the_chiefs_checkpoint(
    first_run: tuple[Path, list[Task]], tmp_path: Path
) -> None:
    # A copy, so that this test does not depend on running after the first one.
    run_dir = tmp_path / "run"
    shutil.copytree(first_run[0], run_dir)
    first_losses = [m["loss"] for m in read_metrics(run_dir)]

    tasks = run_tasks(run_dir, [*EXAMPLE, "--epochs", "3", "--steps-per-epoch", "20"], attempt=1)

    assert_all_succeeded(tasks)
    resumed = f"distlaunch: resumed from {contract.checkpoint_dir(run_dir) / 'ckpt-40'} at step 40"
    for task in tasks:
        assert resumed in task.output
        assert "epoch 1/3" not in task.output and "epoch 2/3" not in task.output
    assert tasks[0].final_loss() == tasks[1].final_loss()
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [20, 40, 60]
    # Restoring really changed the weights: the resumed epoch's loss is nearer the trained
    # model's than a fresh model's (whose first epoch is first_losses[0]).
    assert metrics[-1]["loss"] < (first_losses[0] + first_losses[-1]) / 2
    checkpoints = contract.checkpoint_dir(run_dir)
    assert (checkpoints / "ckpt-60.index").exists()
    assert not any(p.name.startswith("ckpt-8") for p in checkpoints.iterdir())


@pytest.mark.integration
@pytest.mark.timeout(CLUSTER_TIMEOUT_S)
def test_resume_mid_epoch_runs_only_the_remaining_steps(tmp_path: Path) -> None:
    # One process without TF_CONFIG (run by hand, default strategy). Checkpoint at step 30,
    # then continue with 20-step epochs: step 30 is the middle of epoch 2 of 2.
    first = run_tasks(tmp_path, [*EXAMPLE, "--epochs", "2", "--steps-per-epoch", "15"], workers=1)
    assert_all_succeeded(first)

    (task,) = run_tasks(
        tmp_path, [*EXAMPLE, "--epochs", "2", "--steps-per-epoch", "20"], workers=1, attempt=1
    )

    assert_all_succeeded([task])
    assert "at step 30" in task.output
    assert "epoch 1/2" not in task.output and "epoch 2/2 step 40 loss " in task.output
    assert [m["step"] for m in read_metrics(tmp_path)] == [15, 30, 40]
    assert (contract.checkpoint_dir(tmp_path) / "ckpt-40.index").exists()


@pytest.mark.integration
@pytest.mark.timeout(CLUSTER_TIMEOUT_S)
def test_example_trains_tf_keras_fit_on_two_workers(tmp_path: Path) -> None:
    tasks = run_tasks(
        tmp_path, [*EXAMPLE, "--epochs", "2", "--steps-per-epoch", "10"], keras=contract.TF_KERAS
    )

    assert_all_succeeded(tasks)
    assert tasks[0].final_loss() == tasks[1].final_loss()
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == [10, 20]
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    # BackupAndRestore keeps only the chief's backup.
    assert (contract.checkpoint_dir(tmp_path) / "backup" / "chief" / "checkpoint").exists()
