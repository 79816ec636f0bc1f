"""A Keras 3 program in the shape of TensorFlow's multi-worker Keras tutorial, with no import of
distlaunch: MWMS created first, a model built and compiled in its scope, `fit` with the callbacks a
user writes (BackupAndRestore, ModelCheckpoint, TensorBoard, CSVLogger, EarlyStopping), then
`evaluate` and `predict`. It writes what it saw to OUT/result-<task>.json for the tests.

usage: tutorial.py OUT [--workers-batch 64] [--samples 552] [--epochs 3] [--files DIR]
"""

import argparse
import json
import os
import sys
import time

import tensorflow as tf

strategy = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402
import numpy as np  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--global-batch", type=int, default=64)
parser.add_argument("--samples", type=int, default=552)  # 8 full batches of 64 and one of 40
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--files", default=None)  # where the callbacks write; none: no callbacks
# Worker 1 of the first attempt SIGKILLs itself before this global step (1-based): a fault.
parser.add_argument("--die-at", type=int, default=0)
# Every worker of the first attempt waits before this global step (1-based) for the launcher's
# stop notice (printing "waiting for a notice"): the notice then comes mid-step, mid-epoch.
parser.add_argument("--notice-at", type=int, default=0)
# Also distlaunch's own callbacks (the only import of distlaunch, and only with this flag).
parser.add_argument("--dw-callbacks", action="store_true")
# What runs after fit (a test runs only what its assertions read): evaluate, predict.
parser.add_argument("--parts", default="fit,evaluate,predict")
args = parser.parse_args()

rng = np.random.default_rng(7)
x = rng.normal(size=(args.samples, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(args.samples, 1))).astype("float32")
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA


def dataset(xs, ys=None):
    data = (xs, ys) if ys is not None else xs
    return tf.data.Dataset.from_tensor_slices(data).batch(args.global_batch).with_options(options)


class MeanAbsError(keras.metrics.Metric):
    """A user's own metric, defined after the layer went in (merged across workers too)."""

    def __init__(self, name="my_mae", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable((), "zeros", name="total")
        self.count = self.add_variable((), "zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(keras.ops.sum(keras.ops.abs(y_true - y_pred)))
        self.count.assign_add(keras.ops.cast(keras.ops.shape(y_true)[0], "float32"))

    def result(self):
        return keras.ops.divide_no_nan(self.total, self.count)


keras.utils.set_random_seed(1)
with strategy.scope():
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae", MeanAbsError()])

# What each worker's callbacks wrote (the model's save calls, the CSV file it opened), for the
# tests' chief-only checks; and the loss every training step logged.
writes = []
for name in ("save", "save_weights"):
    method = getattr(model, name)

    def spy(filepath, *a, _method=method, **kw):
        writes.append(os.fspath(filepath))
        return _method(filepath, *a, **kw)

    setattr(model, name, spy)
batch_loss = []
batch_metric = []


def _noticed():
    # The layer's notice flag, read without importing distlaunch (a test hook only).
    preempt = sys.modules.get("distlaunch.worker.preempt")
    return preempt is not None and preempt.noticed()


class Record(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        print(f"fit starts at step {int(self.model.optimizer.iterations.numpy())}", flush=True)

    def on_train_batch_begin(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy()) + 1
        first_attempt = os.environ.get("DISTLAUNCH_ATTEMPT", "0") == "0"
        if step == args.die_at and first_attempt and strategy.cluster_resolver.task_id == 1:
            os.kill(os.getpid(), 9)
        if step == args.notice_at and first_attempt:
            print("waiting for a notice", flush=True)
            for _ in range(1200):
                if _noticed():
                    break
                time.sleep(0.1)

    def on_train_batch_end(self, batch, logs=None):
        batch_loss.append(float(logs["loss"]))
        batch_metric.append(float(logs["my_mae"]))

    def on_epoch_end(self, epoch, logs=None):
        for callback in callbacks:
            if isinstance(callback, keras.callbacks.CSVLogger):
                writes.append(callback.csv_file.name)
            if isinstance(callback, keras.callbacks.TensorBoard):
                writes.append(os.path.join(callback._log_write_dir, "tb-events"))


callbacks = []
if args.files:
    # CSVLogger opens its file in a folder that must exist (as in one process); before this, the
    # chief's open raced worker 1's temporary folder inside it, which made it.
    os.makedirs(args.files, exist_ok=True)
    callbacks = [
        keras.callbacks.BackupAndRestore(os.path.join(args.files, "backup"), save_freq=3),
        keras.callbacks.ModelCheckpoint(
            os.path.join(args.files, "ckpt", "best.keras"), save_best_only=True
        ),
        keras.callbacks.CSVLogger(os.path.join(args.files, "log.csv")),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=50),
    ]
    try:
        import tensorboard  # noqa: F401

        callbacks.append(keras.callbacks.TensorBoard(os.path.join(args.files, "tb")))
    except ImportError:
        pass

if args.dw_callbacks:
    import distlaunch.worker as dw

    callbacks += dw.keras_callbacks(checkpoint_every=4)
history = model.fit(
    dataset(x, y),
    epochs=args.epochs,
    validation_data=dataset(x[:100], y[:100]),
    callbacks=[*callbacks, Record()],
    verbose=2,
)
parts = args.parts.split(",")
evaluated = model.evaluate(dataset(x[:200], y[:200]), verbose=0) if "evaluate" in parts else []
predicted = from_files = np.zeros(0)
if "predict" in parts:
    predicted = model.predict(dataset(x[:150]), verbose=0)
    # A dataset read from files (3 of them, 40 rows each), left to TensorFlow's auto-shard policy.
    folder = os.path.join(args.out, f"rows-{strategy.cluster_resolver.task_id}")
    os.makedirs(folder, exist_ok=True)
    names = []
    for i in range(3):
        names.append(os.path.join(folder, f"rows-{i}.txt"))
        with open(names[-1], "w") as f:
            f.writelines(" ".join(str(v) for v in row) + "\n" for row in x[40 * i : 40 * i + 40])
    lines = tf.data.TextLineDataset(names).map(lambda t: tf.strings.to_number(tf.strings.split(t)))
    from_files = model.predict(lines.batch(args.global_batch), verbose=0)
resolver = strategy.cluster_resolver
task = f"{resolver.task_type}-{resolver.task_id}" if resolver.task_type else "single"
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"result-{task}.json"), "w") as f:
    json.dump(
        {
            "loss": history.history["loss"],
            "mae": history.history["mae"],
            "val_loss": history.history["val_loss"],
            "evaluate": evaluated,
            "predict": predicted.ravel().tolist(),
            "predict_files": from_files.ravel().tolist(),
            "iterations": int(model.optimizer.iterations.numpy()),
            "batch_loss": batch_loss,
            "batch_my_mae": batch_metric,
            "writes": writes,
        },
        f,
    )
print(f"final loss {history.history['loss'][-1]:.6f}", flush=True)
