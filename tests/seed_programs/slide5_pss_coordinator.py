# Seed: slide 5 ("Parameter Server Strategy"), as
# written there (it sets no TF_CONFIG by hand: nothing to remove), except:
# - added: `import numpy as np`, which the slide uses but never imports (a NameError otherwise).
# - added: `model.compile(optimizer='adam', loss='mse')` in the scope: the slide's step calls
#   `model.optimizer.apply_gradients` on a model it never compiled (model.optimizer is None:
#   AttributeError; distlaunch's hint "model-not-compiled" says so).
# - indentation restored (the slide's text lost it).
# This is the chief's program: distlaunch runs a TensorFlow server on the ps and worker tasks.
import tensorflow as tf
import numpy as np

# Define the cluster
cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
# Define the strategy
strategy = tf.distribute.experimental.ParameterServerStrategy(cluster_resolver)
# Define the model
with strategy.scope():
    model = tf.keras.Sequential([
        tf.keras.layers.Dense(64, activation='relu', input_shape=(10,)),
        tf.keras.layers.Dense(64, activation='relu'),
        tf.keras.layers.Dense(1)
    ])
    model.compile(optimizer='adam', loss='mse')
# Define the input
def dataset_fn():
    x = np.random.random((1000, 10))
    y = np.random.random((1000, 1))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    return dataset
# Define the training step
@tf.function
def step_fn(iterator):
    def train_step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(features, training=True)
            loss = tf.keras.losses.mse(labels, predictions)
        gradients = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss
    inputs = next(iterator)
    return strategy.run(train_step, args=(inputs,))
# Distributed training
with strategy.scope():
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    per_worker_dataset = coordinator.create_per_worker_dataset(dataset_fn)
    iterator = iter(per_worker_dataset)
    for _ in range(10): # 10 steps
        coordinator.schedule(step_fn, args=(iterator,))
    coordinator.join()
print("Parameter Server training completed")
