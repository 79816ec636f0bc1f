"""The Keras guide's MNIST MLP, trained on every task of a distlaunch job.

    python -m distlaunch.worker.examples.mnist_mlp [--epochs N] [--steps-per-epoch N]
        [--global-batch-size N] [--checkpoint-every N] [--model-fit]

With DISTLAUNCH_KERAS=tf_keras it uses tf_keras ``model.fit`` with
``distlaunch.worker.keras_callbacks()``; otherwise Keras 3 with ``distlaunch.worker.fit``, or
Keras 3's own ``model.fit`` with the same callbacks with ``--model-fit``.
Works offline: real MNIST when ``~/.keras/datasets/mnist.npz`` exists, else generated data of
the same shape. The last line is ``final loss L``, the same on every worker.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

import distlaunch.worker as dw
from distlaunch.worker import contract
from distlaunch.worker.examples import common

if TYPE_CHECKING:
    import tensorflow as tf

MNIST_NPZ = Path.home() / ".keras" / "datasets" / "mnist.npz"
NUM_CLASSES = 10
# Shuffle seed shared by all workers: sharding by element needs the same order everywhere.
SEED = 0


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, train, and print the final loss."""
    parser = common.parser(__doc__.splitlines()[0])
    parser.add_argument("--model-fit", action="store_true", help="Keras 3: model.fit, not dw.fit")
    args = parser.parse_args(argv)

    # Before anything else touches TensorFlow: collective ops are configured at startup.
    strategy = dw.strategy()
    images, labels = load_data()
    with strategy.scope():
        model = build_model(common.keras_module())
    if dw.context().keras == contract.TF_KERAS or args.model_fit:
        loss = train_model_fit(model, images, labels, args)
    else:
        loss = train_keras3(model, images, labels, args)
    print(f"final loss {loss:.6f}", flush=True)


def load_data() -> tuple[np.ndarray, np.ndarray]:
    """Return MNIST's 60000 training images (uint8, 28x28) and labels, or a generated stand-in."""
    if MNIST_NPZ.exists():
        print(f"data: real MNIST from {MNIST_NPZ}", flush=True)
        with np.load(MNIST_NPZ) as data:
            return data["x_train"], data["y_train"]
    print(f"data: generated MNIST-shaped data (no {_tilde(MNIST_NPZ)}; offline)", flush=True)
    # One fixed random prototype per class plus as much noise: learnable, and identical on every
    # worker because the seed is fixed.
    rng = np.random.default_rng(SEED)
    prototypes = rng.integers(0, 256, size=(NUM_CLASSES, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, NUM_CLASSES, size=60000, dtype=np.uint8)
    noise = rng.integers(0, 256, size=(60000, 28, 28), dtype=np.uint8)
    return prototypes[labels] // 2 + noise // 2, labels


def _tilde(path: Path) -> str:
    """Write ``path`` relative to ``~`` the way users know it."""
    return "~/" + str(path.relative_to(Path.home()))


def make_dataset(images: np.ndarray, labels: np.ndarray, global_batch_size: int) -> tf.data.Dataset:
    """Return a repeating, shuffled dataset of (float image, label) batches of the global size."""
    import tensorflow as tf

    return (
        tf.data.Dataset.from_tensor_slices((images, labels))
        .shuffle(10_000, seed=SEED)
        .repeat()
        .batch(global_batch_size, drop_remainder=True)
        .map(lambda x, y: (tf.cast(x, tf.float32) / 255.0, y))
    )


def build_model(k: ModuleType) -> Any:
    """Return the guide's MLP (2 x Dense 256) built with Keras module ``k``, compiled."""
    model = k.Sequential(
        [
            k.Input((28, 28)),
            k.layers.Flatten(),
            k.layers.Dense(256, activation="relu"),
            k.layers.Dense(256, activation="relu"),
            k.layers.Dense(NUM_CLASSES),
        ]
    )
    model.compile(
        optimizer=k.optimizers.Adam(1e-3),
        loss=k.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def train_keras3(
    model: Any, images: np.ndarray, labels: np.ndarray, args: argparse.Namespace
) -> float:
    """Train with Keras 3 and distlaunch.worker.fit; return the last epoch's loss."""
    metrics = dw.fit(
        model,
        make_dataset(images, labels, args.global_batch_size),
        global_batch_size=args.global_batch_size,
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        checkpoint_every=args.checkpoint_every,
    )
    return metrics[-1]["loss"] if metrics else float("nan")


def train_model_fit(
    model: Any, images: np.ndarray, labels: np.ndarray, args: argparse.Namespace
) -> float:
    """Train with the model's own ``fit`` (tf_keras, or Keras 3 through distlaunch's layer) and
    distlaunch.worker.keras_callbacks; return the last loss."""
    import tensorflow as tf

    # In-memory data: shard by element (fit's default AUTO would first try by file).
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = make_dataset(images, labels, args.global_batch_size).with_options(options)
    history = model.fit(
        dataset,
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        callbacks=dw.keras_callbacks(checkpoint_every=args.checkpoint_every),
        verbose=2,
    )
    losses = history.history.get("loss") or [float("nan")]
    return float(losses[-1])


if __name__ == "__main__":
    main()
