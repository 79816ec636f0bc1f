"""Keras 3 ``model.fit`` on 2 MWMS workers (distlaunch's Keras 3 layer) beside tf_keras ``fit``.

The same model and data (a 784-256-256-10 MLP on random MNIST-shaped data, a ``repeat()``ed
dataset, global batch 128) are trained by one program that imports either ``keras`` (Keras 3,
run with ``"keras": "keras3"``: the layer patches it) or ``tf_keras`` (run with ``"keras":
"tf_keras"``), each under `distlaunch up` with 2 workers. Each worker times its own steps after a
warm-up (from the end of step WARMUP to the end of the last step, inside the program, so the
launch and TensorFlow's start are not counted); the figure of a run is its slower worker's
steps/s. The flavours alternate round by round, and the ratio of the medians is printed:
Keras 3 / tf_keras (target >= 0.95).

    python bench/keras3.py [--rounds 3] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import DISTLAUNCH

PROGRAM = """
import json, os, sys, time
import tensorflow as tf
strategy = tf.distribute.MultiWorkerMirroredStrategy()
flavour, steps, warmup, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if flavour == "tf_keras":
    import tf_keras as keras
else:
    import keras
import numpy as np

rng = np.random.default_rng(0)
x = rng.random((4096, 784), dtype=np.float32)
y = rng.integers(0, 10, 4096)
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(128).with_options(options)
with strategy.scope():
    model = keras.Sequential([
        keras.Input((784,)),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )


class Clock(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 == warmup:
            self.start = time.perf_counter()
        if batch + 1 == steps:
            self.rate = (steps - warmup) / (time.perf_counter() - self.start)


clock = Clock()
model.fit(data, epochs=1, steps_per_epoch=steps, callbacks=[clock], verbose=0)
task = strategy.cluster_resolver.task_id
with open(os.path.join(out, f"rate-{task}.json"), "w") as f:
    json.dump(clock.rate, f)
"""


def one_run(folder: Path, flavour: str, steps: int, warmup: int) -> float:
    """Steps/s of one 2-worker `up` of ``flavour`` (its slower worker's)."""
    out = folder / f"out-{flavour}"
    out.mkdir(exist_ok=True)
    for old in out.glob("*.json"):
        old.unlink()
    spec = folder / f"{flavour}.json"
    spec.write_text(
        json.dumps(
            {
                "name": f"bench-{flavour.replace('_', '-')}",
                "strategy": "multi_worker_mirrored",
                "program": {
                    "script": "program.py",
                    "args": [flavour, str(steps), str(warmup), str(out)],
                    "keras": flavour,
                },
                "tasks": {"worker": {"count": 2}},
                "shared_dir": "runs",
            }
        )
    )
    subprocess.run([*DISTLAUNCH, "up", str(spec)], check=True, cwd=folder, capture_output=True)
    return min(json.loads(p.read_text()) for p in out.glob("rate-*.json"))


def main() -> None:
    """Alternate the two flavours for ``--rounds`` and print the medians and their ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"keras3": [], "tf_keras": []}
    with tempfile.TemporaryDirectory(prefix="bench-keras3-") as tmp:
        folder = Path(tmp)
        (folder / "program.py").write_text(PROGRAM)
        for round_ in range(args.rounds):
            for flavour in rates if round_ % 2 == 0 else reversed(list(rates)):
                rate = one_run(folder, flavour, args.steps, args.warmup)
                rates[flavour].append(rate)
                print(f"  round {round_ + 1} {flavour}: {rate:.1f} steps/s", flush=True)
    k3, k2 = statistics.median(rates["keras3"]), statistics.median(rates["tf_keras"])
    print(
        f"keras3 fit on 2 MWMS workers: {k3:.1f} steps/s; tf_keras fit: {k2:.1f} steps/s; "
        f"ratio {k3 / k2:.3f} (target >= 0.95; median of {args.rounds} alternating rounds)"
    )


if __name__ == "__main__":
    sys.exit(main())
