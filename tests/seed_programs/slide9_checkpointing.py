# Seed: slide 9 ("Model Checkpointing and Saving in
# Distributed Setting"), as written there (it sets no TF_CONFIG by hand: nothing to remove),
# except:
# - indentation restored (the slide's text lost it); the loop's body is the slide's
#   `# ... training code here ...` comment and its `checkpoint.save`.
import tensorflow as tf
import os

# Define the strategy
strategy = tf.distribute.MirroredStrategy()
# Create the model within the strategy scope
with strategy.scope():
    model = tf.keras.Sequential([
        tf.keras.layers.Dense(64, activation='relu', input_shape=(10,)),
        tf.keras.layers.Dense(1)
    ])
    model.compile(optimizer='adam', loss='mse')
# Set up checkpointing
checkpoint_dir = './training_checkpoints'
checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt")
checkpoint = tf.train.Checkpoint(model=model)
# Training loop with checkpointing
for epoch in range(5):
    # ... training code here ...
    # Save checkpoint
    checkpoint.save(checkpoint_prefix)
# Save the entire model
model.save('saved_model')
# Load the model (can be done outside the strategy scope)
loaded_model = tf.keras.models.load_model('saved_model')
print("Model saved and loaded successfully")
