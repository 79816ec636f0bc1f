"""ParameterServerStrategy end to end: `distlaunch up` of a chief, 2 workers and 1 ps on localhost.

The chief runs the example program and schedules the steps through a ClusterCoordinator; the ps
and worker tasks only serve, until the launcher stops them. Each cluster run takes 20-40 s on a
2-core machine (5 TensorFlow processes importing at once), so the Keras 3 run is shared by the
training and the resume tests.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import distlaunch, only_run_dir, processes_of_run, run_record, write_spec
from distlaunch.worker import contract, progress, runtime

CNN = "distlaunch.worker.examples.cnn_mnist"
REUTERS = "distlaunch.worker.examples.reuters_conv1d"
PS_TASKS = {"chief": {"count": 1}, "worker": {"count": 2}, "ps": {"count": 1}}
SERVERS = ("worker-0", "worker-1", "ps-0")


def _ps_spec(
    folder: Path,
    module: str,
    args: list[str],
    name: str = "spec.json",
    keras: str = contract.KERAS3,
    **fields,
) -> Path:
    """Write a PSS spec: chief, 2 workers, 1 ps (unless ``fields`` say otherwise) running ``module args``."""
    return write_spec(
        folder,
        name,
        **{
            "strategy": contract.PSS,
            "tasks": PS_TASKS,
            "program": {"module": module, "args": args, "keras": keras},
            **fields,
        },
    )


def _epochs(epochs: int) -> list[str]:
    return ["--epochs", str(epochs), "--steps-per-epoch", "10"]


def _metrics(run_dir: Path, task: str) -> list[dict]:
    return json.loads((run_dir / "metrics" / f"{task}.json").read_text())


def _last_saved_step(run_dir: Path) -> int:
    """The step of the chief's latest checkpoint, from TensorFlow's checkpoint state file."""
    state = (contract.checkpoint_dir(run_dir) / "checkpoint").read_text()
    return int(re.search(r'^model_checkpoint_path: "ckpt-(\d+)"', state, re.M).group(1))


def _assert_servers_stopped_by_sigterm(record: dict) -> None:
    # Stopped by the launcher's SIGTERM, not by the SIGKILL that follows an ignored one.
    for name in SERVERS:
        task = record["tasks"][name]
        assert (task["state"], task["exit"]) == ("stopped", "signal SIGTERM"), (name, task)
    assert not processes_of_run(record["run_id"])


# ---------------------------------------------------------------------------------------------
# Unit tests: no TensorFlow, no subprocess.


@pytest.mark.quick
def test_context_of_a_hand_run_with_ps_tasks_is_pss(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (contract.STRATEGY, contract.ROLE, contract.INDEX):
        monkeypatch.delenv(name, raising=False)
    cluster = {"chief": ["h:1"], "worker": ["h:2", "h:3"], "ps": ["h:4"]}
    monkeypatch.setenv(
        contract.TF_CONFIG, json.dumps({"cluster": cluster, "task": {"type": "ps", "index": 0}})
    )
    ctx = runtime.context()
    assert (ctx.strategy, ctx.role, ctx.is_chief, ctx.num_workers) == (contract.PSS, "ps", False, 2)


@pytest.mark.quick
def test_training_done_marker_counts_for_its_attempt_and_earlier_ones(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(contract.RUN_DIR, str(tmp_path))
    monkeypatch.setenv(contract.ATTEMPT, "1")
    assert progress.training_done(tmp_path, 1) is None
    progress.mark_training_done(42)
    marker = progress.training_done(tmp_path, 1)
    assert marker is not None and (marker["attempt"], marker["step"]) == (1, 42)
    # An evaluator of attempt 0 (the chief alone was restarted) still sees it; one of a later
    # attempt must not take this old marker for its own training's end.
    assert progress.training_done(tmp_path, 0) == marker
    assert progress.training_done(tmp_path, 2) is None


# ---------------------------------------------------------------------------------------------
# Real clusters through the CLI.


@dataclass(frozen=True)
class FirstRun:
    """The Keras 3 run, and what its run dir held right after it (later tests extend the run)."""

    folder: Path
    run_dir: Path
    stdout: str
    record: dict
    metrics: list[dict]
    last_saved_step: int


@pytest.fixture(scope="module")
def keras3_run(tmp_path_factory: pytest.TempPathFactory) -> FirstRun:
    """cnn_mnist with the Keras 3 custom loop: 2 epochs of 10 steps, checkpoints every 5."""
    folder = tmp_path_factory.mktemp("ps")
    run_id = (
        f"ps-keras3-{uuid.uuid4().hex[:8]}"  # unique: processes_of_run looks it up machine-wide
    )
    spec = _ps_spec(folder, CNN, [*_epochs(2), "--checkpoint-every", "5"])
    result = distlaunch("up", "--run-id", run_id, str(spec), cwd=folder)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = folder / "runs" / run_id
    return FirstRun(
        folder,
        run_dir,
        result.stdout,
        run_record(run_dir),
        _metrics(run_dir, "chief-0"),
        _last_saved_step(run_dir),
    )


@pytest.mark.integration
def test_keras3_custom_loop_trains_to_the_requested_steps(keras3_run: FirstRun) -> None:
    run = keras3_run
    assert run.record["state"] == "succeeded"
    assert run.record["tasks"]["chief-0"]["exit_code"] == 0
    # Only the chief runs the program; the servers say so and wait.
    assert re.search(r"^chief-0 +\| final loss ", run.stdout, re.M)
    for name in SERVERS:
        assert re.search(rf"^{name} +\| distlaunch: {name} serving at ", run.stdout, re.M)
    assert not re.search(r"^(worker|ps)-\d +\| (epoch|final loss)", run.stdout, re.M)

    assert [m["step"] for m in run.metrics] == [10, 20]
    assert run.metrics[-1]["loss"] < run.metrics[0]["loss"]
    assert run.last_saved_step == 20
    status = json.loads(contract.status_path(run.run_dir, "chief", 0).read_text())
    assert (status["state"], status["step"]) == ("ready", 20)
    done = json.loads(contract.training_done_path(run.run_dir).read_text())
    assert (done["attempt"], done["step"]) == (0, 20)
    assert list((contract.tensorboard_dir(run.run_dir) / "train").glob("events.out.tfevents.*"))
    _assert_servers_stopped_by_sigterm(run.record)


@pytest.mark.integration
def test_a_second_up_resumes_the_chief_at_its_last_saved_step(keras3_run: FirstRun) -> None:
    run = keras3_run
    spec = _ps_spec(run.folder, CNN, [*_epochs(3), "--checkpoint-every", "5"], name="more.json")
    run_id = run.run_dir.name

    result = distlaunch("up", "--run-id", run_id, str(spec), cwd=run.folder)

    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming run {run_id} (attempt 1)" in result.stderr
    resumed = re.findall(
        r"^chief-0 +\| distlaunch: resumed from (\S+) at step (\d+)$", result.stdout, re.M
    )
    saved = run.last_saved_step
    assert resumed == [(str(contract.checkpoint_dir(run.run_dir) / f"ckpt-{saved}"), str(saved))]
    assert "epoch 1/3" not in result.stdout and "epoch 2/3" not in result.stdout
    assert [m["step"] for m in _metrics(run.run_dir, "chief-0")] == [10, 20, 30]
    _assert_servers_stopped_by_sigterm(run_record(run.run_dir))


@pytest.mark.integration
def test_tf_keras_fit_trains_under_pss(tmp: Path) -> None:
    spec = _ps_spec(tmp, CNN, _epochs(2), keras=contract.TF_KERAS)

    result = distlaunch("up", str(spec), cwd=tmp)

    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = only_run_dir(tmp / "runs")
    metrics = _metrics(run_dir, "chief-0")
    # The step is tf_keras's optimizer.iterations: exact under PSS (a real assign_add).
    assert [m["step"] for m in metrics] == [10, 20]
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert (contract.checkpoint_dir(run_dir) / "backup" / "chief" / "checkpoint").is_file()
    assert json.loads(contract.training_done_path(run_dir).read_text())["step"] == 20
    _assert_servers_stopped_by_sigterm(run_record(run_dir))


@pytest.mark.integration
def test_evaluator_evaluates_the_final_checkpoint_then_exits_by_itself(tmp: Path) -> None:
    spec = _ps_spec(tmp, REUTERS, _epochs(2), tasks={**PS_TASKS, "evaluator": {"count": 1}})

    result = distlaunch("up", str(spec), cwd=tmp)

    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = only_run_dir(tmp / "runs")
    evaluations = _metrics(run_dir, "evaluator-0")
    final = evaluations[-1]
    assert final["step"] == 20 and final["checkpoint"] == str(
        contract.checkpoint_dir(run_dir) / "ckpt-20"
    )
    assert {"loss", "accuracy", "top5_accuracy"} <= set(final)
    assert [e["step"] for e in evaluations] == sorted({e["step"] for e in evaluations})
    assert re.search(r"^evaluator-0 +\| eval step 20 loss \S+ accuracy ", result.stdout, re.M)
    assert list((contract.tensorboard_dir(run_dir) / "eval").glob("events.out.tfevents.*"))
    record = run_record(run_dir)
    # It stopped by itself after the final checkpoint, within the launcher's drain time.
    assert (
        record["tasks"]["evaluator-0"]["state"],
        record["tasks"]["evaluator-0"]["exit_code"],
    ) == ("succeeded", 0)
    _assert_servers_stopped_by_sigterm(record)
