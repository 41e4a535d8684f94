"""DistributedGradientTape in a custom training loop, checked on every rank.

Each rank's data comes from a generator seeded by its rank, and every rank's
plain (unreduced) gradients are gathered with ``allgather_object``, so the
float64 reference (their mean) is computed independently of the collective
under test. Prints "TAPE <check> passed rank=R" per check and
"TAPE OK rank=R size=N" at the end.
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


def make_model(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((6,), dtype="int32"),
        keras.layers.Embedding(20, 4),
        keras.layers.Flatten(),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(3),
    ])
    return model


def batch(step):
    rng = np.random.default_rng([step, RANK])
    x = rng.integers(0, 20, size=(16, 6)).astype(np.int32)
    y = rng.integers(0, 3, size=(16,)).astype(np.int32)
    return tf.constant(x), tf.constant(y)


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def loss_of(model, x, y):
    return LOSS(y, model(x, training=True))


def dense(grad):
    return np.asarray(tf.convert_to_tensor(grad), np.float64)


def reference_mean(model, x, y):
    """The mean over ranks of every rank's plain gradients, in float64."""
    with tf.GradientTape() as tape:
        loss = loss_of(model, x, y)
    local = [dense(g) for g in tape.gradient(loss, model.trainable_variables)]
    everyone = kd.allgather_object(local)
    return [np.mean([grads[i] for grads in everyone], axis=0) for i in range(len(local))], local


def check_close(got, want, what, rtol=1e-5):
    for index, (g, w) in enumerate(zip(got, want)):
        g = dense(g)
        scale = np.max(np.abs(w)) + 1e-12
        error = np.max(np.abs(g - w)) / scale
        assert error <= rtol, f"{what}: gradient {index} differs by {error:.3g} (relative)"


def test_eager_gradients_are_the_mean():
    model = make_model()
    x, y = batch(0)
    want, _ = reference_mean(model, x, y)
    with tf.GradientTape() as tape:
        loss = loss_of(model, x, y)
    grads = kd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    assert isinstance(grads[0], tf.IndexedSlices) or SIZE == 1, type(grads[0])
    check_close(grads, want, "eager")


def test_function_gradients_sparse_as_dense_and_groups():
    model = make_model()
    x, y = batch(1)
    want, _ = reference_mean(model, x, y)
    variables = model.trainable_variables
    for options in ({}, {"sparse_as_dense": True}, {"groups": 2}, {"num_groups": 3},
                    {"groups": [[variables[1], variables[2]], [variables[3]]]},
                    {"gradient_predivide_factor": 4.0}, {"compression": kd.Compression.fp16}):

        before = dict(kd.ops.COUNTERS)
        grads = traced_step(model, options)(x, y)
        calls = kd.ops.COUNTERS["allreduce"] - before.get("allreduce", 0)
        rtol = 2e-3 if "compression" in options else 1e-5
        check_close(grads, want, f"tf.function {options}", rtol)
        if SIZE > 1:
            # 4 dense gradients (the embedding's is sparse: allgathered, unless
            # sparse_as_dense); listed groups: [k2, b2], [k3], and b3 alone.
            expected = {"groups": 2, "num_groups": 3}.get(next(iter(options), ""), 1)
            if isinstance(options.get("groups"), list):
                expected = 3
            assert calls == expected, f"{list(options)}: {calls} allreduce calls, " \
                f"expected {expected}"


def traced_step(model, options):
    """A tf.function computing reduced gradients; ``options`` stay Python values
    (passed as arguments, tf.function would trace the variables in them)."""

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_of(model, x, y)
        tape = kd.DistributedGradientTape(tape, **options)
        return tape.gradient(loss, model.trainable_variables)

    return step


def test_local_source_is_not_reduced():
    model = make_model()
    x, y = batch(2)
    want, local = reference_mean(model, x, y)
    with tf.GradientTape() as tape:
        loss = loss_of(model, x, y)
    last = model.layers[-1]
    tape = kd.PartialDistributedGradientTape(tape, local_layers=last)
    grads = tape.gradient(loss, model.trainable_variables)
    check_close(grads[:3], want[:3], "shared part")
    check_close(grads[3:], [g / SIZE for g in local[3:]], "local layer")


def test_training_loop_ends_bit_identical():
    model = make_model(seed=RANK)  # different starts: the broadcast must fix that
    optimizer = keras.optimizers.Adam(0.01)

    @tf.function
    def train_step(x, y, first_batch):
        with tf.GradientTape() as tape:
            loss = loss_of(model, x, y)
        tape = kd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            kd.broadcast_variables(model.variables, root_rank=0)
            kd.broadcast_variables(optimizer.variables, root_rank=0)
        return loss

    for step in range(5):
        train_step(*batch(10 + step), step == 0)
    weights = [v.numpy().tobytes() for v in model.variables]
    everyone = kd.allgather_object(weights)
    assert all(w == everyone[0] for w in everyone), "weights differ between ranks"


def test_group_graph_ops():
    @tf.function
    def shape_ops():
        return kd.size_op(), kd.rank_op(), kd.local_size_op(), kd.local_rank_op()

    got = [int(t) for t in shape_ops()]
    assert got == [SIZE, RANK, kd.local_size(), kd.local_rank()], got
    assert int(kd.size_op()) == SIZE  # eagerly too


def test_bad_arguments():
    with tf.GradientTape() as tape:
        pass
    for kwargs, text in (({"groups": 0}, "`groups`"), ({"num_groups": -1}, "`num_groups`"),
                         ({"op": "sum"}, "`op`"),
                         ({"op": kd.Sum, "gradient_predivide_factor": 2.0},
                          "`gradient_predivide_factor`")):
        try:
            kd.DistributedGradientTape(tape, **kwargs)
        except ValueError as error:
            assert text in str(error), error
        else:
            raise AssertionError(f"{kwargs} was accepted")


if __name__ == "__main__":
    run_checks([function for name, function in list(globals().items())
                if name.startswith("test_")],
               rank=RANK, passed="TAPE {name} passed rank={rank}", agree=kd.allgather_object)
    print(f"TAPE OK rank={RANK} size={SIZE}", flush=True)
