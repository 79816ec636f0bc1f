"""What the classifier examples share: their arguments, and training or evaluating a built model.

One script serves every task: `train_or_evaluate` trains with Keras 3 and
``distlaunch.worker.fit``, or with tf_keras ``model.fit`` and ``distlaunch.worker.keras_callbacks``
when DISTLAUNCH_KERAS=tf_keras, and on the evaluator task evaluates each new checkpoint instead.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

import distlaunch.worker as dw
from distlaunch.worker import contract

if TYPE_CHECKING:
    import tensorflow as tf

DatasetFn = Callable[["tf.distribute.InputContext"], "tf.data.Dataset"]
ToInputs = Callable[["tf.Tensor", "tf.Tensor"], tuple["tf.Tensor", "tf.Tensor"]]
EVAL_BATCH = 500


def parser(description: str) -> argparse.ArgumentParser:
    """Return an argument parser with the training options every example takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=20)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--checkpoint-every", type=int, default=None, help="steps (default: epoch)")
    return parser


def make_dataset_fn(
    features: np.ndarray, labels: np.ndarray, global_batch_size: int, to_inputs: ToInputs
) -> DatasetFn:
    """Return ``input_context -> dataset`` of shuffled, repeating training batches mapped by
    ``to_inputs``.

    Under MWMS each worker reads its own shard; under PSS the function runs on every worker
    with a single input pipeline, and the unseeded shuffle gives each worker its own order.
    """
    import tensorflow as tf

    def dataset_fn(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        batch = input_context.get_per_replica_batch_size(global_batch_size)
        return (
            tf.data.Dataset.from_tensor_slices((features, labels))
            .shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
            .shuffle(10_000)
            .repeat()
            .batch(batch, drop_remainder=True)
            .map(to_inputs)
        )

    return dataset_fn


def eval_dataset(features: np.ndarray, labels: np.ndarray, to_inputs: ToInputs) -> tf.data.Dataset:
    """Return the held-out examples as one pass of batches mapped by ``to_inputs``."""
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((features, labels)).batch(EVAL_BATCH).map(to_inputs)


def keras_module() -> ModuleType:
    """Return tf_keras when the task runs tf_keras, else Keras 3: the examples' layers, losses,
    optimizers and metrics are spelled the same in both."""
    if dw.context().keras == contract.TF_KERAS:
        import tf_keras as module
    else:
        import keras as module
    return module


def train_or_evaluate(
    model: Any, dataset_fn: DatasetFn, eval_dataset: tf.data.Dataset, args: argparse.Namespace
) -> None:
    """Train ``model`` (compiled under the task's strategy) on ``dataset_fn`` and print
    ``final loss L``; on the evaluator, evaluate the run's checkpoints on ``eval_dataset``."""
    if dw.context().role == contract.EVALUATOR:
        dw.evaluate_checkpoints(model, eval_dataset)
        return
    if dw.context().keras == contract.TF_KERAS:
        loss = _train_tf_keras(model, dataset_fn, args)
    else:
        loss = _train_keras3(model, dataset_fn, args)
    print(f"final loss {loss:.6f}", flush=True)


def _train_keras3(model: Any, dataset_fn: DatasetFn, args: argparse.Namespace) -> float:
    """Train with distlaunch.worker.fit; return the last epoch's loss."""
    metrics = dw.fit(
        model,
        dataset_fn,
        global_batch_size=args.global_batch_size,
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        checkpoint_every=args.checkpoint_every,
    )
    return metrics[-1]["loss"] if metrics else float("nan")


def _train_tf_keras(model: Any, dataset_fn: DatasetFn, args: argparse.Namespace) -> float:
    """Train with tf_keras model.fit (under PSS it needs a DatasetCreator and steps_per_epoch);
    return the last epoch's loss."""
    import tf_keras

    history = model.fit(
        tf_keras.utils.experimental.DatasetCreator(dataset_fn),
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        callbacks=dw.keras_callbacks(checkpoint_every=args.checkpoint_every),
        verbose=2,
    )
    losses = history.history.get("loss") or [float("nan")]
    return float(losses[-1])
