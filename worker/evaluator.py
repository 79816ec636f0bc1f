"""The evaluator: a sidecar task that evaluates each new checkpoint of a run while it trains.

It is not part of the training cluster (its TF_CONFIG names only itself, and its strategy is
TensorFlow's default). It watches the run's checkpoint directory, restores each new checkpoint
the chief writes into its own copy of the model, evaluates it and records the result, and it
stops by itself after the final checkpoint, which the chief announces with the run's
"training done" marker.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from . import contract, progress, runtime

if TYPE_CHECKING:
    import keras

# How often the checkpoint directory and the marker are looked at (seconds).
POLL_INTERVAL_S = 1.0


def evaluate_checkpoints(
    model: keras.Model,
    dataset: tf.data.Dataset,
    *,
    steps: int | None = None,
    checkpoint_dir: Path | None = None,
    poll_interval_s: float = POLL_INTERVAL_S,
) -> list[dict[str, Any]]:
    """Evaluate every new checkpoint of the run until training is done; return the metrics list.

    ``model`` must be built and compiled with the loss and metrics to report (it is evaluated
    with ``model.evaluate(dataset, steps=steps)``) and hold the same layers as the trained one.
    ``checkpoint_dir`` defaults to DISTLAUNCH_CHECKPOINT_DIR, where `distlaunch.worker.fit`
    saves ``ckpt-<step>``.

    For each checkpoint it prints ``eval step S loss L <metric> M ...``, appends ``{"step",
    "checkpoint", "loss", <metrics>}`` to the metrics file (DISTLAUNCH_METRICS_FILE), writes
    the values to TensorBoard (``<run dir>/tensorboard/eval``) and refreshes the heartbeat.
    Only the latest checkpoint is evaluated when several arrived meanwhile, and one deleted
    before it could be read is skipped; one already in the metrics file (evaluated by an
    earlier attempt) is not evaluated again. Returns once the "training done" marker of this
    attempt or a later one exists and the final checkpoint is evaluated; without
    DISTLAUNCH_RUN_DIR there is no marker, and it runs until stopped.
    """
    ctx = runtime.context()
    directory = checkpoint_dir or ctx.checkpoint_dir
    if directory is None:
        raise ValueError(
            f"no checkpoint directory: set {contract.CHECKPOINT_DIR} or pass checkpoint_dir"
        )
    # Every earlier entry stays: each describes a checkpoint that really was evaluated.
    metrics = progress.MetricsLog(
        contract.env_path(contract.METRICS_FILE), keep_until_step=sys.maxsize
    )
    evaluated = {entry["checkpoint"] for entry in metrics.entries}
    scalars = progress.Scalars("eval")
    heartbeat = progress.Heartbeat()
    checkpoint = tf.train.Checkpoint(model=model)
    last_step = metrics.entries[-1]["step"] if metrics.entries else None
    print(f"distlaunch: evaluating the checkpoints in {directory} as they appear", flush=True)
    while True:
        # The marker is read before the directory: the chief saves its final checkpoint before
        # it writes the marker, so once the marker is seen the listing includes that checkpoint.
        done = (
            ctx.run_dir is not None and progress.training_done(ctx.run_dir, ctx.attempt) is not None
        )
        latest = tf.train.latest_checkpoint(str(directory))
        if latest is not None and latest not in evaluated:
            evaluated.add(latest)
            entry = _evaluate(model, checkpoint, latest, dataset, steps)
            if entry is not None:
                metrics.append(entry)
                scalars.write(
                    entry["step"],
                    {k: v for k, v in entry.items() if k not in ("step", "checkpoint")},
                )
                last_step = entry["step"]
                heartbeat.beat(last_step, force=True)
        if done:
            if latest is None:
                raise RuntimeError(
                    f"training finished without a checkpoint in {directory} to evaluate (this "
                    "reads distlaunch.worker.fit's checkpoints, not tf_keras BackupAndRestore's)"
                )
            return metrics.entries
        heartbeat.beat(last_step)
        time.sleep(poll_interval_s)


def _evaluate(
    model: keras.Model,
    checkpoint: tf.train.Checkpoint,
    path: str,
    dataset: tf.data.Dataset,
    steps: int | None,
) -> dict[str, Any] | None:
    """Restore ``path`` into ``model`` and evaluate it; None if the chief deleted it meanwhile."""
    try:
        # The checkpoint also holds the optimizer's slots and the step counter, which an
        # evaluator has no use for; the model's own variables must all be there.
        checkpoint.restore(path).expect_partial().assert_existing_objects_matched()
    except tf.errors.NotFoundError:
        # The chief keeps only its last few checkpoints: this one was rotated out.
        print(f"distlaunch: {path} was deleted before it could be evaluated; skipped", flush=True)
        return None
    results = model.evaluate(dataset, steps=steps, verbose=0, return_dict=True)
    # dw.fit names its checkpoints ckpt-<step>.
    step = int(path.rsplit("-", 1)[1])
    # The loss first, then the compiled metrics.
    values = {
        name: float(results[name]) for name in sorted(results, key=lambda name: name != "loss")
    }
    print(f"eval step {step} " + " ".join(f"{k} {v:.6f}" for k, v in values.items()), flush=True)
    return {"step": step, "checkpoint": path, **values}
