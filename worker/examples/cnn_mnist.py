"""Seed 001's Conv2D classifier on MNIST-shaped images, under either distlaunch strategy.

    python -m distlaunch.worker.examples.cnn_mnist [--epochs N] [--steps-per-epoch N]
        [--global-batch-size N] [--checkpoint-every N] [--train-examples N]

Made for ParameterServerStrategy (cluster_specs/local_ps.json); the same script runs under
MultiWorkerMirroredStrategy. Keras 3 trains with ``distlaunch.worker.fit``; with
DISTLAUNCH_KERAS=tf_keras, tf_keras ``model.fit``. An evaluator task evaluates every new
checkpoint on held-out images instead of training. Works offline: real MNIST when
``~/.keras/datasets/mnist.npz`` exists, else generated data of the same shape (see mnist_mlp).
The training program's last line is ``final loss L``.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

import distlaunch.worker as dw
from distlaunch.worker.examples import common
from distlaunch.worker.examples.mnist_mlp import NUM_CLASSES, load_data

if TYPE_CHECKING:
    import tensorflow as tf

# The last images of the training set are held out for the evaluator.
EVAL_EXAMPLES = 5000
# Under PSS every worker builds its own input pipeline, so the training images travel inside
# the dataset function to each worker: all 55000 (43 MB) cost seconds per worker at startup.
DEFAULT_TRAIN_EXAMPLES = 10000


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, then train (or, on the evaluator, evaluate checkpoints)."""
    parser = common.parser(__doc__.splitlines()[0])
    parser.add_argument("--train-examples", type=int, default=DEFAULT_TRAIN_EXAMPLES)
    args = parser.parse_args(argv)

    # Before anything else touches TensorFlow. On a PSS ps or worker task this serves and never
    # returns: the rest runs on the chief (and on the evaluator).
    strategy = dw.strategy()
    images, labels = load_data()
    with strategy.scope():
        model = build_model(common.keras_module())
    train = slice(-EVAL_EXAMPLES - args.train_examples, -EVAL_EXAMPLES)
    common.train_or_evaluate(
        model,
        common.make_dataset_fn(images[train], labels[train], args.global_batch_size, _to_inputs),
        common.eval_dataset(images[-EVAL_EXAMPLES:], labels[-EVAL_EXAMPLES:], _to_inputs),
        args,
    )


def build_model(k: ModuleType) -> Any:
    """Return seed 001's classifier built with Keras module ``k``, compiled. The seed's last
    layer had a softmax under a ``from_logits=True`` loss; here it outputs the logits."""
    model = k.Sequential(
        [
            k.Input((28, 28, 1)),
            k.layers.Conv2D(32, (3, 3), activation="relu"),
            k.layers.MaxPooling2D(2, 2),
            k.layers.Conv2D(64, (3, 3), activation="relu"),
            k.layers.Flatten(),
            k.layers.Dense(64, activation="relu"),
            k.layers.Dense(NUM_CLASSES),
        ]
    )
    model.compile(
        optimizer=k.optimizers.Adam(1e-3),
        loss=k.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[k.metrics.SparseCategoricalAccuracy(name="accuracy")],
    )
    return model


def _to_inputs(x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """uint8 28x28 images -> float 28x28x1 in [0, 1]."""
    import tensorflow as tf

    return tf.cast(x, tf.float32)[..., None] / 255.0, y


if __name__ == "__main__":
    main()
