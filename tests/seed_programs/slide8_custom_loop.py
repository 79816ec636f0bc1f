# Seed: slide 8 ("Custom Training Loops for
# Fine-grained Control"), as written there (it sets no TF_CONFIG by hand: nothing to remove),
# except:
# - `tf.distribute.MirroredStrategy()` became `tf.distribute.MultiWorkerMirroredStrategy()`: the
#   slide's loop is run on several workers, which MirroredStrategy (one machine) ignores.
# - added: `import numpy as np`, which the slide uses but never imports (a NameError otherwise).
# - indentation restored (the slide's text lost it).
import tensorflow as tf
import numpy as np

# Define the strategy
strategy = tf.distribute.MultiWorkerMirroredStrategy()
# Create the model and optimizer within the strategy scope
with strategy.scope():
    model = tf.keras.Sequential([
        tf.keras.layers.Dense(64, activation='relu', input_shape=(10,)),
        tf.keras.layers.Dense(1)
    ])
    optimizer = tf.keras.optimizers.Adam()
# Define the loss function
def compute_loss(labels, predictions):
    per_example_loss = tf.keras.losses.mse(labels, predictions)
    return tf.nn.compute_average_loss(per_example_loss)
# Define the training step
@tf.function
def train_step(inputs):
    features, labels = inputs
    with tf.GradientTape() as tape:
        predictions = model(features, training=True)
        loss = compute_loss(labels, predictions)
    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return loss
# Define the distributed training step
@tf.function
def distributed_train_step(dataset_inputs):
    per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)
# Create a distributed dataset
x = np.random.random((1000, 10))
y = np.random.random((1000, 1))
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
dist_dataset = strategy.experimental_distribute_dataset(dataset)
# Custom training loop
for epoch in range(5):
    total_loss = 0.0
    num_batches = 0
    for x in dist_dataset:
        total_loss += distributed_train_step(x)
        num_batches += 1
    train_loss = total_loss / num_batches
    print(f"Epoch {epoch+1}, Loss: {train_loss.numpy():.4f}")
print("Custom training loop completed")
