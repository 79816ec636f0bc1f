"""Elastic runs, the worker side (issue 49): a checkpoint resumes at another world size, and the
batch follows the world as the elastic rule says.

No document says that a MultiWorkerMirroredStrategy checkpoint restores at another worker
count; here real runs show it. One run dir is trained by 3 workers, resumed by 2, then by 3
again, each attempt an ordinary `distlaunch up --run-id` of a spec with that many workers and
more epochs. The program (elastic_programs/linear.py) is a linear regression with zero initial
weights and plain SGD, so this file recomputes every step in numpy: every epoch's loss and the
final weights must be those of one process that trained the same global batches, across both
resizes. The launcher's elastic variables (contract.ELASTIC_BATCH, WORLD_SIZE, BASE_WORKERS,
WORLD) are given to `up`'s environment, which local tasks inherit, as the plan of an elastic
run sets them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import wait_for, write_spec
from distlaunch.worker import contract, elastic, runtime

PROGRAM = Path(__file__).parent / "elastic_programs" / "linear.py"
# linear.py's numbers.
SAMPLES, FEATURES, BATCH, STEPS_PER_EPOCH, LEARNING_RATE = 60, 4, 12, 3, 0.1


def _elastic_env(rule: str, world: int, base: int = 3, low: int = 2) -> dict[str, str]:
    return {
        contract.ELASTIC_BATCH: rule,
        contract.WORLD_SIZE: str(world),
        contract.BASE_WORKERS: str(base),
        contract.WORLD: f"{world} of {low}:{base}",
    }


# -- the rule, without TensorFlow ---------------------------------------------------------------


def _ctx(workers: int, strategy: str = contract.MWMS) -> runtime.TaskContext:
    return runtime.TaskContext(
        role="worker",
        index=0,
        attempt=0,
        run_id="r",
        run_dir=None,
        strategy=strategy,
        keras=contract.KERAS3,
        is_chief=True,
        num_workers=workers,
        checkpoint_dir=None,
    )


@pytest.mark.quick
def test_global_keeps_the_global_batch_and_per_worker_keeps_each_workers(monkeypatch):
    for name, value in _elastic_env("global", 2).items():
        monkeypatch.setenv(name, value)
    kept = elastic.world_batch(64, _ctx(2))
    assert (kept.global_size, kept.per_worker) == (64, 32)
    assert kept.line() == "distlaunch: world 2 of 2:3 workers: global batch 64, 32 per worker"

    monkeypatch.setenv(contract.ELASTIC_BATCH, "per_worker")
    grown = elastic.world_batch(63, _ctx(2))  # written for 3 workers: 21 each
    assert (grown.global_size, grown.per_worker) == (42, 21)
    assert grown.line() == "distlaunch: world 2 of 2:3 workers: global batch 42, 21 per worker"

    # Under PSS a step is one worker's batch however many workers there are.
    scheduled = elastic.world_batch(63, _ctx(2, contract.PSS))
    assert scheduled.global_size == 63
    assert scheduled.line() == (
        "distlaunch: world 2 of 2:3 workers: each step is one worker's batch of 63 (parameter server)"
    )


@pytest.mark.quick
def test_the_world_is_said_once_per_process(monkeypatch, capsys):
    for name, value in _elastic_env("global", 2).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(elastic, "_said", set())
    elastic.say_world(_ctx(2))  # keras_callbacks, when the program never asked for its batch
    elastic.say_world(_ctx(2))
    assert capsys.readouterr().out.splitlines() == [
        "distlaunch: world 2 of 2:3 workers: the batch is the dataset's "
        "(batch it at dw.global_batch_size(N) to follow elastic.batch 'global')"
    ]
    monkeypatch.setattr(elastic, "_said", set())
    elastic.say(elastic.world_batch(64, _ctx(2)))  # dw.fit or dw.global_batch_size first
    elastic.say(elastic.world_batch(64, _ctx(2)))
    elastic.say_world(_ctx(2))
    assert capsys.readouterr().out.splitlines() == [
        "distlaunch: world 2 of 2:3 workers: global batch 64, 32 per worker"
    ]


@pytest.mark.quick
def test_outside_an_elastic_run_nothing_changes_and_the_context_has_the_base(monkeypatch):
    for name in (contract.ELASTIC_BATCH, contract.WORLD_SIZE, contract.BASE_WORKERS):
        monkeypatch.delenv(name, raising=False)
    cluster = {"worker": ["a:1", "b:1"]}
    monkeypatch.setenv(contract.TF_CONFIG, json.dumps({"cluster": cluster, "task": {}}))
    plain = elastic.world_batch(65)  # does not divide: MWMS splits it unevenly, as before
    assert (plain.rule, plain.global_size) == (None, 65)
    assert runtime.context().base_workers == runtime.context().num_workers == 2
    monkeypatch.setenv(contract.BASE_WORKERS, "3")
    assert (runtime.context().num_workers, runtime.context().base_workers) == (2, 3)


@pytest.mark.quick
def test_a_batch_the_rule_cannot_keep_is_one_line_and_exit_2(tmp):
    say = "import distlaunch.worker as dw; print(dw.global_batch_size({}))"
    cluster = {"worker": ["a:1", "b:1", "c:1"]}
    env = {
        **os.environ,
        contract.TF_CONFIG: json.dumps({"cluster": cluster, "task": {"type": "worker"}}),
        contract.ERROR_FILE: str(tmp / "error.json"),
    }
    cases = {
        ("global", 64): "distlaunch: global batch 64 does not divide over 3 workers "
        '(elastic.batch "global"): list the sizes that divide it in elastic.sizes ([1, 2] here), '
        'or set elastic.batch to "per_worker"',
        ("per_worker", 64): "distlaunch: global batch 64 does not divide over the 3 workers it "
        'was written for (elastic.batch "per_worker"): make it a multiple of 3',
    }
    for (rule, batch), line in cases.items():
        done = subprocess.run(
            [sys.executable, "-c", say.format(batch)],
            env={**env, **_elastic_env(rule, 3)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == contract.EXIT_FATAL
        assert done.stderr.splitlines() == [line]
        assert done.stdout == ""
        assert json.loads((tmp / "error.json").read_text())["message"] == line.removeprefix(
            "distlaunch: "
        )
    fits = subprocess.run(
        [sys.executable, "-c", say.format(66)],
        env={**env, **_elastic_env("per_worker", 2)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert fits.returncode == 0, fits.stderr
    assert fits.stdout.splitlines() == [
        "distlaunch: world 2 of 2:3 workers: global batch 44, 22 per worker",
        "44",
    ]


# What dw.fit makes of a dataset and of a dataset function under "per_worker", written for 3
# workers at a global batch of 12 (4 each), in a world of 2: global 8, 4 a replica.
REBATCH = """
import json
import tensorflow as tf
from distlaunch.worker import runtime, train

def fn(ctx):
    batch = ctx.get_per_replica_batch_size(12)  # as written: 12 over this world's replicas
    mine = tf.data.Dataset.range(100).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
    return mine.batch(batch)

size, dataset = train._batch_of_this_world(12, tf.data.Dataset.range(100).batch(12), runtime.context())
_, made = train._batch_of_this_world(12, fn, runtime.context())
replica = made(tf.distribute.InputContext(2, 1, 2))
first = [[b.numpy().tolist() for b in d.take(2)] for d in (dataset, replica)]
print(json.dumps([size, *first]))
"""


def test_per_worker_rebatches_a_dataset_and_a_dataset_functions_batches(tmp):
    cluster = {"worker": ["a:1", "b:1"]}
    done = subprocess.run(
        [sys.executable, "-c", REBATCH],
        env={
            **os.environ,
            contract.TF_CONFIG: json.dumps({"cluster": cluster, "task": {"type": "worker"}}),
            **_elastic_env("per_worker", 2),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "distlaunch: world 2 of 2:3 workers: global batch 8, 4 per worker"
    size, batches, replica = json.loads(lines[-1])
    assert size == 8
    assert batches == [list(range(8)), list(range(8, 16))]  # the same examples, in order
    assert replica == [[1, 3, 5, 7], [9, 11, 13, 15]]  # input pipeline 1's shard, 4 a replica


# -- real runs: 3 workers, then 2, then 3 on one run dir ---------------------------------------


def _reference(attempts: list[tuple[int, int]]) -> tuple[list[float], list[float]]:
    """Every epoch's mean loss and the final weights (kernel, bias) of one process that trains
    linear.py's model for each attempt's (steps, global batch), each attempt reading the data
    from its start (float64: the runs' float32 agree to about 1e-6)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, FEATURES)).astype("float32").astype(float)
    y = (x @ rng.normal(size=(FEATURES, 1)).astype(float) + 0.5).astype("float32").astype(float)
    w, b, losses = np.zeros((FEATURES, 1)), 0.0, []
    for steps, batch in attempts:
        for step in range(steps):
            rows = np.arange(step * batch, (step + 1) * batch) % SAMPLES  # a repeating stream
            error = x[rows] @ w + b - y[rows]
            losses.append(float(np.mean(error**2)))
            w = w - LEARNING_RATE * 2 * x[rows].T @ error / batch
            b = b - LEARNING_RATE * 2 * float(error.sum()) / batch
    epochs = [float(np.mean(losses[i : i + STEPS_PER_EPOCH])) for i in range(0, len(losses), 3)]
    return epochs, [*w.ravel().tolist(), b]


def _up_command(tmp: Path, workers: int, program: dict, *args: int) -> list[str]:
    """`distlaunch up --run-id r` of a spec of ``workers`` workers running ``program`` with
    ``args`` (epochs, and steps per epoch) after its own."""
    spec = write_spec(
        tmp,
        f"spec{workers}.json",
        program={**program, "args": [*program["args"], *map(str, args)]},
        tasks={"worker": {"count": workers}},
    )
    return [sys.executable, "-m", "distlaunch.launcher", "up", "--run-id", "r", str(spec)]


def _up(tmp: Path, workers: int, program: dict, env: dict[str, str], *args: int) -> None:
    """Run `_up_command` to its end; it must succeed."""
    done = subprocess.run(
        _up_command(tmp, workers, program, *args),
        cwd=tmp,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _logs(run_dir: Path, attempt: int) -> list[str]:
    folder = run_dir / "logs" / f"attempt-{attempt}"
    return [p.read_text() for p in sorted(folder.glob("worker-*.log"))]


def _resized_three_times(tmp: Path, program: dict, rule: str) -> Path:
    """Train on 3 workers (2 epochs), resume on 2 (to 4), then on 3 (to 6); the run dir."""
    shutil.copy(PROGRAM, tmp / "task.py")
    for workers, epochs in ((3, 2), (2, 4), (3, 6)):
        _up(tmp, workers, program, _elastic_env(rule, workers), epochs)
    return tmp / "runs" / "r"


def _assert_continues(run_dir: Path, resumed: str, batches: list[int]) -> None:
    """Each attempt's workers resumed where the last one saved, every epoch's loss (the chief's
    metrics file, all attempts) and the final weights are one process's on those batches."""
    for attempt, step in ((1, 6), (2, 12)):
        logs = _logs(run_dir, attempt)
        assert len(logs) == (2, 3)[attempt - 1]
        for log in logs:
            assert f"distlaunch: resumed from {resumed.format(step=step)} at step {step}\n" in log
    epochs, weights = _reference([(6, batch) for batch in batches])
    metrics = json.loads((run_dir / "metrics" / "worker-0.json").read_text())
    assert [m["step"] for m in metrics] == [3, 6, 9, 12, 15, 18]
    assert [m["loss"] for m in metrics] == pytest.approx(epochs, rel=1e-4)
    # The loss continues from the checkpoint's: a fresh start would be back at the first value.
    assert metrics[2]["loss"] < metrics[1]["loss"] < metrics[0]["loss"] / 2
    final = re.findall(r"^weights (.*)$", _logs(run_dir, 2)[0], re.M)
    assert json.loads(final[0]) == pytest.approx(weights, abs=1e-5)


def test_dw_fit_resumes_at_another_world_size_and_per_worker_keeps_each_workers_batch(tmp):
    run_dir = _resized_three_times(tmp, {"script": "task.py", "args": ["dwfit"]}, "per_worker")
    for attempt, workers, global_batch in ((0, 3, 12), (1, 2, 8), (2, 3, 12)):
        line = (
            f"distlaunch: world {workers} of 2:3 workers: global batch {global_batch}, 4 per worker"
        )
        assert all(log.count(line) == 1 for log in _logs(run_dir, attempt))
    _assert_continues(run_dir, f"{run_dir}/checkpoints/ckpt-{{step}}", [12, 8, 12])


@pytest.mark.parametrize("keras", [contract.TF_KERAS, contract.KERAS3])
def test_keras_backup_and_restore_resumes_at_another_world_size(tmp, keras):
    """model.fit with dw.keras_callbacks (BackupAndRestore backing up at each epoch's last step
    by ``checkpoint_every``; tf_keras's also saves on a notice; Keras 3 through the layer) under
    the "global" rule: 12 examples a step at every size. Each resume starts the next epoch."""
    program = {"script": "task.py", "args": ["keras"], "keras": keras}
    run_dir = _resized_three_times(tmp, program, "global")
    for attempt, workers, part in ((0, 3, 4), (1, 2, 6), (2, 3, 4)):
        line = f"distlaunch: world {workers} of 2:3 workers: global batch 12, {part} per worker"
        assert all(log.count(line) == 1 for log in _logs(run_dir, attempt))
    _assert_continues(run_dir, f"{run_dir}/checkpoints/backup", [12, 12, 12])


def test_a_notice_save_resumes_on_more_workers_with_no_step_lost(tmp):
    """What a grow does: a stop notice to 2 workers, which save at a step they agree on and exit
    EXIT_PREEMPTED; then 3 workers resume from that very step (the only checkpoint: epochs of
    1000 steps never end before the notice)."""
    shutil.copy(PROGRAM, tmp / "task.py")
    program = {"script": "task.py", "args": ["dwfit"]}
    out = (tmp / "out.txt").open("w")
    launcher = subprocess.Popen(
        _up_command(tmp, 2, program, 1000, 1000),
        cwd=tmp,
        env={**os.environ, **_elastic_env("global", 2)},
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run_dir = tmp / "runs" / "r"
    status = [contract.status_path(run_dir, "worker", i) for i in (0, 1)]
    try:
        wait_for(
            lambda: all(
                p.exists() and json.loads(p.read_text()).get("step", 0) > 50 for p in status
            ),
            "both workers to train 50 steps",
            launcher=launcher,
        )
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=240)
    finally:
        launcher.kill()
    assert launcher.returncode == contract.EXIT_PREEMPTED, (tmp / "out.txt").read_text()[-3000:]
    saved = {json.loads(p.read_text())[contract.SAVED_STEP] for p in status}
    assert len(saved) == 1
    step = saved.pop()
    assert step > 50
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("ckpt-*.index")) == [
        f"ckpt-{step}.index"
    ]

    epochs = step // 1000 + 2
    _up(tmp, 3, program, _elastic_env("global", 3), epochs, 1000)
    logs = _logs(run_dir, 1)
    assert len(logs) == 3
    for log in logs:
        assert f"distlaunch: resumed from {run_dir}/checkpoints/ckpt-{step} at step {step}\n" in log
        assert "distlaunch: world 3 of 2:3 workers: global batch 12, 4 per worker\n" in log
        assert f"epoch {epochs}/{epochs} step {epochs * 1000} loss " in log
    # (Weights are not compared here: after hundreds of steps the model has converged, and a lost
    # step would not show in them.)
