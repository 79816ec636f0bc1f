# Seed: slide 4 ("MultiWorkerMirroredStrategy for
# Multi-Machine Training"), as written there, except:
# - removed: the hand-set TF_CONFIG (the `os.environ['TF_CONFIG'] = json.dumps({...})` statement
#   and its comment); distlaunch writes each task's TF_CONFIG.
# - added: `import numpy as np`, which the slide uses but never imports (a NameError otherwise).
# - indentation restored (the slide's text lost it).
import tensorflow as tf
import os
import numpy as np

# Define the strategy
strategy = tf.distribute.MultiWorkerMirroredStrategy()
# Create the model within the strategy scope
with strategy.scope():
    model = tf.keras.Sequential([
        tf.keras.layers.Dense(64, activation='relu', input_shape=(10,)),
        tf.keras.layers.Dense(64, activation='relu'),
        tf.keras.layers.Dense(1)
    ])
    model.compile(optimizer='adam', loss='mse')
# Generate some random data
x = np.random.random((1000, 10))
y = np.random.random((1000, 1))
# Train the model
history = model.fit(x, y, epochs=5, batch_size=32 * strategy.num_replicas_in_sync)
print("Multi-worker distributed training completed")
