"""A linear regression trained with dw.fit, tf_keras model.fit or Keras 3 model.fit (the layer),
small enough that the tests recompute every step in numpy: zero initial weights, plain SGD, MSE,
a fixed dataset read in order (no shuffle) and batched at the global batch.

usage: linear.py MODE EPOCHS [STEPS_PER_EPOCH]
MODE: dwfit | keras (the spec's "keras" picks tf_keras or Keras 3); STEPS_PER_EPOCH: 3 unless given

Every attempt reads the data from its first batch again (`dw.fit` and BackupAndRestore count
steps, they do not replay data). The chief prints ``weights <json>``: the kernel then the bias.
"""

import json
import sys

import numpy as np

import distlaunch.worker as dw

SAMPLES, FEATURES, BATCH, STEPS_PER_EPOCH, LEARNING_RATE = 60, 4, 12, 3, 0.1


def data() -> tuple[np.ndarray, np.ndarray]:
    """The fixed dataset (the tests build the same one)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1)) + 0.5).astype("float32")
    return x, y


def main() -> None:
    mode, epochs = sys.argv[1], int(sys.argv[2])
    steps_per_epoch = int(sys.argv[3]) if len(sys.argv) > 3 else STEPS_PER_EPOCH
    strategy = dw.strategy()
    import tensorflow as tf

    if dw.context().keras == "tf_keras":
        import tf_keras as keras
    else:
        import keras

    x, y = data()
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    # dw.fit applies the elastic batch rule itself; model.fit takes the dataset's batch.
    batch = BATCH if mode == "dwfit" else dw.global_batch_size(BATCH)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch).with_options(options)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((FEATURES,)), keras.layers.Dense(1, kernel_initializer="zeros")]
        )
        model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss="mse")
    if mode == "dwfit":
        dw.fit(
            model, dataset, global_batch_size=BATCH, epochs=epochs, steps_per_epoch=steps_per_epoch
        )
    else:
        model.fit(
            dataset,
            epochs=epochs,
            steps_per_epoch=steps_per_epoch,
            # Backups by steps that fall on each epoch's last step: a resume starts the next
            # epoch (tf_keras does; Keras 3 through the layer), not the finished one again.
            callbacks=dw.keras_callbacks(checkpoint_every=steps_per_epoch),
            verbose=0,
        )
    kernel, bias = (np.asarray(w).ravel().tolist() for w in model.get_weights())
    if dw.context().is_chief:
        print(f"weights {json.dumps(kernel + bias)}", flush=True)


if __name__ == "__main__":
    main()
