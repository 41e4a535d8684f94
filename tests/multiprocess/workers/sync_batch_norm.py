"""SyncBatchNormalization on every rank against a float64 reference.

Ranks hold batches of different sizes (rank r has 3 + 2r rows), so the
statistics must be weighted by batch size. The reference is computed on every
rank from every rank's inputs (regenerated from their seeds): outputs in
numpy float64, and input gradients of the summed losses by a plain float64
BatchNormalization on the concatenated global batch. Prints
"SYNCBN <check> passed rank=R" per check.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

import keras_dist as kd  # noqa: E402
from tests.multiprocess.workers._checks import run_checks  # noqa: E402

kd.init()
RANK, SIZE = kd.rank(), kd.size()
EPSILON = 1e-3


def inputs_of(rank):
    rng = np.random.default_rng([7, rank])
    return (rng.normal(3.0, 2.0, size=(3 + 2 * rank, 4, 5))).astype(np.float32)


def loss_weights_of(rank):
    return np.random.default_rng([8, rank]).normal(size=(3 + 2 * rank, 4, 5))


def test_training_outputs_and_moving_statistics():
    layer = kd.SyncBatchNormalization(epsilon=EPSILON, momentum=0.5)
    out = layer(tf.constant(inputs_of(RANK)), training=True).numpy()
    everything = np.concatenate([inputs_of(r) for r in range(SIZE)]).astype(np.float64)
    mean = everything.mean(axis=(0, 1))
    variance = everything.var(axis=(0, 1))
    want = (inputs_of(RANK) - mean) / np.sqrt(variance + EPSILON)
    assert np.max(np.abs(out - want)) < 1e-4, np.max(np.abs(out - want))
    assert np.allclose(layer.moving_mean.numpy(), 0.5 * mean, rtol=1e-5, atol=1e-5)
    assert np.allclose(layer.moving_variance.numpy(), 0.5 + 0.5 * variance, rtol=1e-5)


def test_input_gradients_match_the_global_batch():
    layer = kd.SyncBatchNormalization(epsilon=EPSILON)
    x = tf.constant(inputs_of(RANK))
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(layer(x, training=True) * loss_weights_of(RANK).astype(np.float32))
    got = tape.gradient(loss, x).numpy()

    reference = keras.layers.BatchNormalization(epsilon=EPSILON, dtype="float64")
    everything = tf.constant(np.concatenate([inputs_of(r) for r in range(SIZE)]), tf.float64)
    weights = np.concatenate([loss_weights_of(r) for r in range(SIZE)])
    with tf.GradientTape() as tape:
        tape.watch(everything)
        total = tf.reduce_sum(reference(everything, training=True) * weights)
    start = sum(3 + 2 * r for r in range(RANK))
    want = tape.gradient(total, everything).numpy()[start:start + 3 + 2 * RANK]
    scale = np.max(np.abs(want))
    assert np.max(np.abs(got - want)) / scale < 1e-4, np.max(np.abs(got - want)) / scale


def test_in_a_compiled_model_weights_stay_identical():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4, 5)), kd.SyncBatchNormalization(),
                              keras.layers.Flatten(), keras.layers.Dense(1)])
    model.compile(optimizer=kd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    y = np.random.default_rng(RANK).normal(size=(3 + 2 * RANK, 1))
    model.fit(inputs_of(RANK), y, batch_size=16, epochs=2, verbose=0)
    weights = [w.tobytes() for w in model.get_weights()]
    assert all(w == weights for w in kd.allgather_object(weights)), "weights differ"


if __name__ == "__main__":
    run_checks([function for name, function in list(globals().items())
                if name.startswith("test_")],
               rank=RANK, passed="SYNCBN {name} passed rank={rank}", agree=kd.allgather_object)
