# Seed: slide 6 ("Synchronous vs. Asynchronous
# Training"), as written there (it sets no TF_CONFIG by hand: nothing to remove), except:
# - indentation restored (the slide's text lost it).
# This is the chief's program: distlaunch runs a TensorFlow server on the ps and worker tasks.
import tensorflow as tf

# Synchronous training (default in MirroredStrategy)
sync_strategy = tf.distribute.MirroredStrategy()
with sync_strategy.scope():
    model = tf.keras.Sequential([
        tf.keras.layers.Dense(64, activation='relu', input_shape=(10,)),
        tf.keras.layers.Dense(1)
    ])
    model.compile(optimizer='adam', loss='mse')
# Asynchronous training (using ParameterServerStrategy)
cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
variable_partitioner = (
    tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=(256 << 10),
        max_shards=2))
async_strategy = tf.distribute.experimental.ParameterServerStrategy(
    cluster_resolver,
    variable_partitioner=variable_partitioner)
with async_strategy.scope():
    model = tf.keras.Sequential([
        tf.keras.layers.Dense(64, activation='relu', input_shape=(10,)),
        tf.keras.layers.Dense(1)
    ])
    model.compile(optimizer='adam', loss='mse')
print("Models created for both synchronous and asynchronous training")
