"""Seed 004's Conv1D classifier of Reuters newswires (46 topics), under either strategy.

    python -m distlaunch.worker.examples.reuters_conv1d [--epochs N] [--steps-per-epoch N]
        [--global-batch-size N] [--checkpoint-every N]

Made for ParameterServerStrategy (cluster_specs/local_ps_eval.json, with an evaluator); the same
script runs under MultiWorkerMirroredStrategy. Keras 3 trains with ``distlaunch.worker.fit``;
with DISTLAUNCH_KERAS=tf_keras, tf_keras ``model.fit``. An evaluator task evaluates every new
checkpoint on the held-out newswires instead of training. Works offline: the real Reuters
newswires when ``~/.keras/datasets/reuters.npz`` exists, else generated data of the same shape.
The training program's last line is ``final loss L``.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

import distlaunch.worker as dw
from distlaunch.worker.examples import common

if TYPE_CHECKING:
    import tensorflow as tf

REUTERS_NPZ = Path.home() / ".keras" / "datasets" / "reuters.npz"
MAX_LEN = 300  # words per newswire after padding or truncation, as in the seed
NUM_CLASSES = 46
# The real dataset's size, its vocabulary (largest word index + 1) and its 80/20 split.
NUM_EXAMPLES = 11228
GENERATED_VOCAB = 30980
TEST_FRACTION = 0.2
# Fixed so that every task builds the same data and the same split.
SEED = 113


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, then train (or, on the evaluator, evaluate checkpoints)."""
    args = common.parser(__doc__.splitlines()[0]).parse_args(argv)

    # Before anything else touches TensorFlow. On a PSS ps or worker task this serves and never
    # returns: the rest runs on the chief (and on the evaluator).
    strategy = dw.strategy()
    words, topics, vocab = load_data()
    split = int(len(words) * (1 - TEST_FRACTION))
    with strategy.scope():
        model = build_model(common.keras_module(), vocab)
    common.train_or_evaluate(
        model,
        common.make_dataset_fn(words[:split], topics[:split], args.global_batch_size, _to_inputs),
        common.eval_dataset(words[split:], topics[split:], _to_inputs),
        args,
    )


def load_data() -> tuple[np.ndarray, np.ndarray, int]:
    """Return padded word-index sequences [N, MAX_LEN], topics [N] and the vocabulary size,
    from the real newswires (shuffled) or a generated stand-in."""
    rng = np.random.default_rng(SEED)
    if REUTERS_NPZ.exists():
        print(f"data: real Reuters newswires from {REUTERS_NPZ}", flush=True)
        with np.load(REUTERS_NPZ, allow_pickle=True) as data:
            sequences, topics = list(data["x"]), data["y"].astype(np.int32)
        order = rng.permutation(len(sequences))
        words = pad([sequences[i] for i in order])
        return words, topics[order], int(words.max()) + 1
    print(f"data: generated Reuters-shaped data (no {REUTERS_NPZ}; offline)", flush=True)
    return *_generate(rng), GENERATED_VOCAB


def _generate(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Newswires of random length whose words are random, except that half of them are
    drawn from 10 keywords of the newswire's topic: learnable, like the real task."""
    keywords = rng.integers(1, GENERATED_VOCAB, size=(NUM_CLASSES, 10))
    topics = rng.integers(0, NUM_CLASSES, size=NUM_EXAMPLES).astype(np.int32)
    sequences = []
    for topic in topics:
        length = int(rng.integers(20, MAX_LEN + 1))
        words = rng.integers(1, GENERATED_VOCAB, size=length)
        is_keyword = rng.random(length) < 0.5
        words[is_keyword] = rng.choice(keywords[topic], size=int(is_keyword.sum()))
        sequences.append(words)
    return pad(sequences), topics


def pad(sequences: list[Any]) -> np.ndarray:
    """Pad with zeros in front, or keep the last MAX_LEN words (Keras's pad_sequences defaults).

    uint16 when the word indices fit: under PSS the data travels to every worker."""
    largest = max((int(max(s)) for s in sequences if len(s)), default=0)
    out = np.zeros((len(sequences), MAX_LEN), np.uint16 if largest < 2**16 else np.int32)
    for row, sequence in enumerate(sequences):
        kept = np.asarray(sequence[-MAX_LEN:])
        if len(kept):
            out[row, MAX_LEN - len(kept) :] = kept
    return out


def build_model(k: ModuleType, vocab: int) -> Any:
    """Return seed 004's classifier built with Keras module ``k``, compiled. The seed's last
    layer had a softmax under a ``from_logits=True`` loss; here it outputs the logits."""
    model = k.Sequential(
        [
            k.Input((MAX_LEN,), dtype="int32"),
            k.layers.Embedding(vocab, 7),
            k.layers.Conv1D(filters=64, kernel_size=5, activation="relu"),
            k.layers.MaxPooling1D(2),
            k.layers.Conv1D(filters=32, kernel_size=3, activation="relu"),
            k.layers.MaxPooling1D(2),
            k.layers.Flatten(),
            k.layers.Dense(NUM_CLASSES),
        ]
    )
    model.compile(
        optimizer=k.optimizers.Nadam(),
        loss=k.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[
            k.metrics.SparseCategoricalAccuracy(name="accuracy"),
            k.metrics.SparseTopKCategoricalAccuracy(5, name="top5_accuracy"),
        ],
    )
    return model


def _to_inputs(words: tf.Tensor, topic: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Token ids as int32 (the Embedding layer's input), the topic unchanged."""
    import tensorflow as tf

    return tf.cast(words, tf.int32), topic


if __name__ == "__main__":
    main()
