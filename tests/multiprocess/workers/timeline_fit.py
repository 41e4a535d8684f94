"""Worker for test_timeline.py: a short fit with TimelineCallback, then named collectives.

Prints, on every rank, the trainable variables' paths and the number of
train batches, so the test can match the timeline against them.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

import keras_dist as kd  # noqa: E402

kd.init()
rank, size = kd.rank(), kd.size()
rng = np.random.default_rng(rank)
x = rng.normal(size=(96, 6)).astype("float32")
y = rng.normal(size=(96, 1)).astype("float32")
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, name="hidden"),
                          keras.layers.Dense(1, name="out")])
model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.01)), "mse")
model.fit(x, y, batch_size=32, epochs=2, verbose=0,
          callbacks=[kd.callbacks.BroadcastGlobalVariablesCallback(0),
                     kd.callbacks.TimelineCallback()])
values = [rng.normal(size=7) for _ in range(3)]
summed = kd.allreduce(values[0], op=kd.Sum, name="probe_allreduce")
gathered = kd.allgather(np.full((rank + 1, 2), rank, np.float64), name="probe_allgather")
assert gathered.shape == (size * (size + 1) // 2, 2)
print("PATHS " + ",".join(v.path for v in model.trainable_variables))
print(f"BATCHES {2 * 3}")
print(f"TIMELINE WORKER DONE rank={rank}")
