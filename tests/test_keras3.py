"""Keras 3 `fit`, `evaluate` and `predict` of a program that never imports distlaunch, under `up`
on 2 and 3 real MWMS workers (worker/keras3/), compared with one process of the same program.

The program (tests/keras3_programs/tutorial.py) is TensorFlow's multi-worker Keras tutorial in
shape: global batch 64 over 552 samples (a last batch of 40), so 3 workers split every batch
unevenly (22/21/21, then 14/13/13). Each patch is then switched off once (KERAS3_LAYER_OFF) to
show the upstream bug it answers, in a run as short as the bug needs (one epoch, no evaluate or
predict where the bug shows in fit). Each `up` costs a TensorFlow start per worker: tests that
can read one run share it (the 2-worker run with the user's callbacks and dw.keras_callbacks()).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import distlaunch, only_run_dir, wait_for, wait_for_run_dir, write_spec
from distlaunch.worker import contract

pytestmark = pytest.mark.integration

PROGRAM = Path(__file__).resolve().parent / "keras3_programs" / "tutorial.py"
EPOCHS = 3
RTOL = 1e-4


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= RTOL * max(abs(y), 1e-6) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """The program's results in one process (no TF_CONFIG, no distlaunch), same global batch."""
    out = tmp_path_factory.mktemp("one")
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    done = subprocess.run(
        [sys.executable, str(PROGRAM), str(out), "--epochs", str(EPOCHS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "result-single.json").read_text())


def _up(
    tmp: Path, workers: int, *args: str, off: str = ""
) -> tuple[subprocess.CompletedProcess, dict]:
    """`up` the program on ``workers`` workers with ``"keras": "keras3"``; its results by task."""
    out = tmp / "out"
    program = {
        "script": str(PROGRAM),
        "args": [str(out), "--epochs", str(EPOCHS), *args],
        "keras": "keras3",
        "env": {"KERAS3_LAYER_OFF": off} if off else {},
    }
    spec = write_spec(tmp, program=program, tasks={"worker": {"count": workers}})
    result = distlaunch("up", str(spec), cwd=tmp, timeout=400)
    results = {p.stem[len("result-") :]: json.loads(p.read_text()) for p in out.glob("*.json")}
    return result, results


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, dict]:
    """One 2-worker run with the user's callbacks and dw.keras_callbacks() both (its folder,
    `up`'s result, the results by task): the callback tests and dw's share it."""
    tmp = tmp_path_factory.mktemp("two")
    result, results = _up(tmp, 2, "--files", str(tmp / "files"), "--dw-callbacks")
    return tmp, result, results


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_two_workers_with_the_callbacks_match_one_process(two_workers, one_process):
    tmp, result, results = two_workers
    files = tmp / "files"
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(results) == ["worker-0", "worker-1"]
    for task, got in results.items():
        assert _close(got["loss"], one_process["loss"]), (task, got["loss"], one_process["loss"])
        assert _close(got["val_loss"], one_process["val_loss"]), task
        assert _close(got["batch_loss"], one_process["batch_loss"]), task
        assert _close(got["evaluate"], one_process["evaluate"]), task
        assert _close(got["predict"], one_process["predict"]), task
        assert _close(got["predict_files"], one_process["predict_files"]), task
        assert got["iterations"] == one_process["iterations"] == 27
    # Every worker logged the same loss each epoch, in its own log too.
    logs = sorted((only_run_dir(tmp / "runs") / "logs" / "attempt-0").glob("worker-*.log"))
    epoch_lines = [[ln for ln in p.read_text().splitlines() if " - loss: " in ln] for p in logs]
    assert len(epoch_lines) == 2 and len(epoch_lines[0]) == EPOCHS
    assert [ln.split(" - loss: ")[1] for ln in epoch_lines[0]] == [
        ln.split(" - loss: ")[1] for ln in epoch_lines[1]
    ]
    # Only the chief's files at the user's paths; the backup is gone after training, as in one
    # process; the other worker wrote into its temporary folders only.
    left = _files(files)
    assert "ckpt/best.keras" in left and "log.csv" in left
    assert not any("workertemp" in name or name.startswith("backup") for name in left), left
    assert all("workertemp_1" in path for path in results["worker-1"]["writes"])
    assert not any("workertemp" in path for path in results["worker-0"]["writes"])
    assert len((files / "log.csv").read_text().splitlines()) == EPOCHS + 1
    if (files / "tb").exists():  # TensorBoard (where the tensorboard package is installed)
        assert any(p.name.startswith("events.out") for p in (files / "tb").rglob("*"))
        assert any(path.endswith("tb-events") for path in results["worker-1"]["writes"])


def test_three_workers_split_unevenly_match_one_process(tmp, one_process):
    files = tmp / "files"
    result, results = _up(tmp, 3, "--files", str(files))
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(results) == ["worker-0", "worker-1", "worker-2"]
    left = _files(files)
    assert "ckpt/best.keras" in left and not any("workertemp" in name for name in left), left
    for index in (1, 2):
        assert all(f"workertemp_{index}" in p for p in results[f"worker-{index}"]["writes"])
    for task, got in results.items():
        assert _close(got["loss"], one_process["loss"]), (task, got["loss"], one_process["loss"])
        assert _close(got["batch_loss"], one_process["batch_loss"]), task
        assert _close(got["batch_my_mae"], one_process["batch_my_mae"]), task
        assert _close(got["evaluate"], one_process["evaluate"]), task
        assert _close(got["predict"], one_process["predict"]), task


@pytest.mark.parametrize(
    "patch, upstream",
    [
        ("symbolic-build", "Attempt to convert a value (PerReplica"),
        ("reduce-logs", "Invalid reduction dimension 0"),
    ],
)
def test_without_the_patch_fit_fails_as_upstream(tmp, patch, upstream):
    result, results = _up(tmp, 2, "--epochs", "1", "--parts", "fit", off=patch)
    assert result.returncode != 0 and not results
    assert upstream in result.stdout + result.stderr


def test_without_loss_by_samples_an_uneven_split_drifts(tmp, one_process):
    result, results = _up(tmp, 3, "--epochs", "1", "--parts", "fit", off="loss-by-samples")
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(results["worker-0"]["loss"]) == 1
    assert not _close(results["worker-0"]["loss"], one_process["loss"][:1])


def test_without_merged_metrics_step_logs_are_not_one_process(tmp, one_process):
    result, results = _up(tmp, 3, "--epochs", "1", "--parts", "fit", off="merged-metrics")
    assert result.returncode == 0, result.stderr[-3000:]
    got = results["worker-0"]
    assert len(got["loss"]) == 1 and len(got["batch_loss"]) == 9
    assert _close(got["loss"], one_process["loss"][:1])  # the epoch's state is still summed
    assert not _close(got["batch_loss"], one_process["batch_loss"][:9])


def test_without_the_callback_patches_every_worker_writes_the_users_paths(tmp):
    files = tmp / "files"
    off = "backup-and-restore,model-checkpoint,csv-logger,tensorboard"
    result, results = _up(tmp, 2, "--files", str(files), "--epochs", "1", "--parts", "fit", off=off)
    writes = results.get("worker-1", {}).get("writes") if results else None
    if writes is None:  # it crashed on the shared HDF5 file (BlockingIOError), as upstream does
        assert result.returncode != 0
        return
    user = [path for path in writes if "workertemp" not in path]
    assert any(path.endswith("latest.weights.h5") for path in user)  # BackupAndRestore
    assert any(path.endswith("best.keras") for path in user)  # ModelCheckpoint
    assert any(path.endswith("log.csv") for path in user)  # CSVLogger
    if (files / "tb").exists():  # TensorBoard (where the tensorboard package is installed)
        assert any(path.endswith("tb-events") for path in user)


def test_worker_killed_mid_epoch_two_resumes_from_the_backup_at_its_step(tmp, one_process):
    """Worker 1 SIGKILLs itself before global step 14 (epoch 2, step 5; the backup holds 12):
    the gang restarts, restores the chief's BackupAndRestore and skips the 3 steps of epoch 2 it
    holds, so the optimizer counts the uninterrupted run's steps and ends where it ends."""
    files = tmp / "files"
    out = tmp / "out"
    program = {
        "script": str(PROGRAM),
        "args": [str(out), "--epochs", str(EPOCHS), "--files", str(files), "--die-at", "14"]
        + ["--parts", "evaluate"],
        "keras": "keras3",
    }
    spec = write_spec(tmp, program=program, restart={"policy": "on-failure", "max_restarts": 2})
    result = distlaunch("up", str(spec), cwd=tmp, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "worker-1 was killed by signal SIGKILL: restarting" in result.stderr
    for task in ("worker-0", "worker-1"):
        got = json.loads((out / f"result-{task}.json").read_text())
        assert got["iterations"] == one_process["iterations"] == 27
        # The resumed fit runs epochs 2 and 3; epoch 3 is the uninterrupted run's.
        assert len(got["loss"]) == 2
        assert _close(got["loss"][-1:], one_process["loss"][-1:]), (task, got["loss"])
        assert _close(got["val_loss"], one_process["val_loss"][1:]), task
        assert _close(got["evaluate"], one_process["evaluate"]), task
    assert not (files / "backup").exists()


def _noticed_at_14(tmp: Path, off: str = "", save_s: int = 60) -> tuple[Path, Path, int, str]:
    """`up` the program with its callbacks, every worker waiting before global step 14 (epoch 2,
    step 5) until it has had a notice; send the notice (SIGTERM to `up`) once both wait. Returns
    the spec, the run dir, `up`'s exit code and its stderr."""
    program = {
        "script": str(PROGRAM),
        "args": [str(tmp / "out"), "--epochs", str(EPOCHS), "--files", str(tmp / "files")]
        + ["--notice-at", "14", "--parts", "evaluate"],
        "keras": "keras3",
        "env": {"KERAS3_LAYER_OFF": off} if off else {},
    }
    timeouts = {"grace_s": 2, "startup_s": 120, "save_s": save_s}
    spec = write_spec(tmp, program=program, timeouts=timeouts)
    with open(tmp / "stderr.txt", "w") as err:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "distlaunch.launcher", "up", str(spec)],
            cwd=tmp,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        run_dir = wait_for_run_dir(tmp / "runs", launcher)
        logs = run_dir / "logs" / "attempt-0"
        wait_for(
            lambda: (
                launcher.poll() is not None
                or (
                    len(found := list(logs.glob("worker-*.log"))) == 2
                    and all("waiting for a notice" in p.read_text() for p in found)
                )
            ),
            "both workers to wait before step 14",
        )
        assert launcher.poll() is None, (tmp / "stderr.txt").read_text()[-3000:]
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=240)
    finally:
        launcher.kill()
    return spec, run_dir, launcher.returncode, (tmp / "stderr.txt").read_text()


def _saved_steps(run_dir: Path) -> list[list[str]]:
    logs = sorted((run_dir / "logs" / "attempt-0").glob("worker-*.log"))
    return [re.findall(r"stop notice: saved step (\d+)", p.read_text()) for p in logs]


def test_a_stop_notice_mid_epoch_saves_an_agreed_step_and_the_resume_loses_none(tmp, one_process):
    """Every worker learns of the notice in step 14's all-reduce and saves the user's
    BackupAndRestore there (its periodic backup held step 12), exits preempted; `up --resume`
    restores step 14 and the optimizer counts the uninterrupted run's 27 steps."""
    spec, run_dir, code, stderr = _noticed_at_14(tmp)
    assert code == contract.EXIT_PREEMPTED, stderr[-3000:]
    assert _saved_steps(run_dir) == [["14"], ["14"]]
    out = tmp / "out"
    assert not list(out.glob("result-*.json"))  # the first attempt ended at the notice
    resumed = distlaunch("up", str(spec), "--resume", cwd=tmp, timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for log in sorted((run_dir / "logs" / "attempt-1").glob("worker-*.log")):
        assert "fit starts at step 14" in log.read_text(), log
    for task in ("worker-0", "worker-1"):
        got = json.loads((out / f"result-{task}.json").read_text())
        assert got["iterations"] == one_process["iterations"] == 27
        assert len(got["loss"]) == 2  # epochs 2 and 3; epoch 3 is the uninterrupted run's
        assert _close(got["loss"][-1:], one_process["loss"][-1:]), (task, got["loss"])
        assert _close(got["evaluate"], one_process["evaluate"]), task


def test_without_stop_notice_the_notice_is_lost(tmp):
    """Keras 3 has no save on a notice, and TensorFlow's notifier only logs it: the workers
    train on (here: wait) until the launcher's save deadline stops the run unsaved."""
    _, run_dir, code, stderr = _noticed_at_14(tmp, off="stop-notice", save_s=3)
    assert code != contract.EXIT_PREEMPTED, stderr[-3000:]
    assert _saved_steps(run_dir) == [[], []]


def test_dw_keras_callbacks_serve_keras3_fit(two_workers, one_process):
    tmp, result, results = two_workers
    assert result.returncode == 0, result.stderr[-3000:]
    for task in ("worker-0", "worker-1"):
        assert _close(results[task]["loss"], one_process["loss"]), task
        lines = [ln for ln in result.stdout.splitlines() if ln.startswith(f"{task} | epoch ")]
        assert [ln.split(" loss ")[0] for ln in lines] == [
            f"{task} | epoch {e}/3 step {9 * e}" for e in (1, 2, 3)
        ]
    run_dir = only_run_dir(tmp / "runs")
    backup = list((run_dir / "checkpoints").rglob("latest.weights.h5"))
    assert len(backup) == 1 and "workertemp" not in str(backup[0]), backup


def test_without_predict_by_data_files_are_predicted_out_of_order(tmp, one_process):
    """3 files over 2 workers, sharded by FILE: worker 0 predicts 2 batches, worker 1 one; the
    second gather pairs with nothing (the collective aborts), or the rows come out of order."""
    result, results = _up(tmp, 2, "--parts", "predict", off="predict-by-data")
    if result.returncode != 0:
        assert "CollectiveGather" in result.stdout + result.stderr
        return
    assert not _close(results["worker-0"]["predict_files"], one_process["predict_files"])
