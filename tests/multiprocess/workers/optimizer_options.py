"""DistributedOptimizer's Horovod options on every rank, against float64 references.

Every rank's gradients (or data) come from generators seeded by that rank, so
each rank recomputes every other rank's inputs and the reference without any
collective. Shared results must also be bit-identical on every rank. Prints
"OPTOPTS <check> passed rank=R" per check.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

import keras_dist as kd  # noqa: E402
from keras_dist.data import shard  # noqa: E402
from keras_dist.tensor.ops import COUNTERS  # noqa: E402
from tests.multiprocess.workers._checks import run_checks  # noqa: E402

kd.init(process_sets="dynamic")  # the process-set check adds its set
RANK, SIZE = kd.rank(), kd.size()

SHAPES = [(4, 3), (3,), (3, 2), (2,)]
LR = 0.5


def grads_of(rank, seed, shapes=SHAPES):
    rng = np.random.default_rng([seed, rank])
    return [rng.normal(size=shape) for shape in shapes]


def start_values(seed, shapes=SHAPES):
    rng = np.random.default_rng([seed, 999])
    return [rng.normal(size=shape) for shape in shapes]


def variables_from(values):
    return [keras.Variable(v.astype("float32")) for v in values]


def mean_over(ranks, seed):
    everyone = [grads_of(r, seed) for r in ranks]
    return [np.mean([g[i] for g in everyone], axis=0) for i in range(len(SHAPES))]


def close(actual, expected, what, rtol=1e-6, atol=1e-6):
    for index, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(np.asarray(a, np.float64), e, rtol=rtol, atol=atol,
                                   err_msg=f"{what}: variable {index}")


def same_on_every_rank(arrays, what, ranks=None):
    blobs = kd.allgather_object([np.asarray(a).tobytes() for a in arrays])
    for rank in ranks if ranks is not None else range(SIZE):
        assert blobs[rank] == blobs[(ranks or [0])[0]], f"{what}: rank {rank} differs"


def one_step(optimizer, variables, seed):
    grads = [tf.constant(g, tf.float32) for g in grads_of(RANK, seed)]
    tf.function(lambda *gs: optimizer.apply(list(gs), variables))(*grads)


def test_groups_split_the_allreduce():
    for seed, options, calls in ((1, {}, 1), (2, {"groups": 2}, 2), (3, {"num_groups": 3}, 3),
                                 (4, {"groups": 4}, 4), (5, "lists", 3)):
        start = start_values(seed)
        variables = variables_from(start)
        if options == "lists":  # [v0, v2] together, v1 and v3 one allreduce each
            options = {"groups": [[variables[0], variables[2]]]}
        optimizer = kd.DistributedOptimizer(keras.optimizers.SGD(LR), **options)
        before = COUNTERS["allreduce"]
        one_step(optimizer, variables, seed)
        made = COUNTERS["allreduce"] - before
        assert made == (calls if SIZE > 1 else 0), f"{options}: {made} allreduce calls"
        expected = [w - LR * g for w, g in zip(start, mean_over(range(SIZE), seed))]
        close([v.numpy() for v in variables], expected, str(options))
        same_on_every_rank([v.numpy() for v in variables], str(options))


def test_local_variables_keep_their_gradients():
    for seed, scale in ((10, True), (11, False)):
        start = start_values(seed)
        variables = variables_from(start)
        optimizer = kd.DistributedOptimizer(keras.optimizers.SGD(LR),
                                            scale_local_gradients=scale)
        optimizer.register_local_var(variables[1])
        optimizer.register_local_var(variables[3])
        one_step(optimizer, variables, seed)
        mean, own = mean_over(range(SIZE), seed), grads_of(RANK, seed)
        expected = [start[0] - LR * mean[0], start[1] - LR * own[1] / (SIZE if scale else 1),
                    start[2] - LR * mean[2], start[3] - LR * own[3] / (SIZE if scale else 1)]
        close([v.numpy() for v in variables], expected, f"scale_local_gradients={scale}")
        same_on_every_rank([variables[0].numpy(), variables[2].numpy()], "shared variables")


def test_partial_distributed_optimizer_local_layers():
    seed = 12
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    start = [np.asarray(v, np.float64) for v in model.trainable_variables]
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    optimizer = kd.PartialDistributedOptimizer(keras.optimizers.SGD(LR),
                                               local_layers=[model.layers[1]])
    grads = [tf.constant(g, tf.float32) for g in grads_of(RANK, seed, shapes)]
    before = COUNTERS["allreduce"]
    optimizer.apply(grads, model.trainable_variables)
    assert COUNTERS["allreduce"] - before == (1 if SIZE > 1 else 0)
    everyone = [grads_of(r, seed, shapes) for r in range(SIZE)]
    mean = [np.mean([g[i] for g in everyone], axis=0) for i in range(2)]
    own = grads_of(RANK, seed, shapes)
    expected = [start[0] - LR * mean[0], start[1] - LR * mean[1],
                start[2] - LR * own[2] / SIZE, start[3] - LR * own[3] / SIZE]
    close(model.trainable_variables, expected, "PartialDistributedOptimizer")
    same_on_every_rank([np.asarray(v) for v in model.trainable_variables[:2]], "shared layer")


def linear_grads(w, b, x, y):
    """Gradients of the mean squared error of ``x @ w + b`` against ``y``."""
    d = 2.0 * (x @ w + b - y) / y.size
    return [x.T @ d, d.sum(0)]


def test_accumulation_counts_every_pass_and_communicates_every_k():
    """k passes per update: k-th step allreduces, iterations and the schedule see every pass."""
    passes, local_batch, steps = 3, 4, 6
    rng = np.random.default_rng(20)
    x, y = rng.normal(size=(SIZE * local_batch * steps, 5)), rng.normal(size=(SIZE * local_batch
                                                                             * steps, 1))
    x_local, y_local = shard((x.astype("float32"), y.astype("float32")),
                             batch_size=local_batch)
    global_batch = SIZE * local_batch
    for how in ("sum", "average", "keras"):
        keras.utils.set_random_seed(21)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
        start = [np.asarray(v, np.float64) for v in model.get_weights()]
        schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.9)
        if how == "keras":
            optimizer = kd.DistributedOptimizer(
                keras.optimizers.SGD(schedule, gradient_accumulation_steps=passes))
        else:
            optimizer = kd.DistributedOptimizer(
                keras.optimizers.SGD(schedule), backward_passes_per_step=passes,
                average_aggregated_gradients=how == "average")
        model.compile(optimizer, "mse")
        before = COUNTERS["allreduce"]
        model.fit(x_local, y_local, batch_size=local_batch, epochs=1, shuffle=False, verbose=0)
        made = COUNTERS["allreduce"] - before
        assert made == (steps // passes if SIZE > 1 else 0), f"{how}: {made} allreduce calls"
        assert int(optimizer.iterations) == steps, (how, int(optimizer.iterations))
        w, b = start
        for update in range(steps // passes):
            total = [0.0, 0.0]
            for step in range(update * passes, (update + 1) * passes):
                rows = slice(step * global_batch, (step + 1) * global_batch)
                total = [t + g for t, g in zip(total, linear_grads(w, b, x[rows], y[rows]))]
            if how != "sum":
                total = [t / passes for t in total]
            rate = 0.1 * 0.9 ** ((update + 1) * passes - 1)  # the schedule at the k-th pass
            w, b = w - rate * total[0], b - rate * total[1]
        close(model.get_weights(), [w, b], f"accumulation {how}", rtol=2e-5, atol=2e-6)
        same_on_every_rank(model.get_weights(), f"accumulation {how}")


def test_compute_gradients_with_local_variables_and_accumulation():
    """Horovod's compute-then-apply path: running sums, local ones scaled, in tf.function."""
    passes, seed = 2, 30
    shapes = [(3,), (2, 2)]
    start = start_values(seed, shapes)
    local_var, shared = [tf.Variable(v.astype("float32")) for v in start]
    optimizer = kd.DistributedOptimizer(keras.optimizers.SGD(1.0),
                                        backward_passes_per_step=passes)
    optimizer.register_local_var(local_var)
    own = grads_of(RANK, seed, shapes)
    coefficients = [tf.constant(c, tf.float32) for c in own]
    mean = np.mean([grads_of(r, seed, shapes)[1] for r in range(SIZE)], axis=0)

    @tf.function
    def step():
        def loss():
            return (tf.reduce_sum(coefficients[0] * local_var)
                    + tf.reduce_sum(coefficients[1] * shared))

        pairs = optimizer._compute_gradients(loss, var_list=[local_var, shared])
        optimizer.apply_gradients(pairs)

    for index in range(5):
        step()
        updates = (index + 1) // passes
        expected = [start[0] - updates * passes * own[0] / SIZE,
                    start[1] - updates * passes * mean]
        close([local_var.numpy(), shared.numpy()], expected, f"step {index}")
        assert int(optimizer.iterations) == index + 1
    same_on_every_rank([shared.numpy()], "shared variable")


def test_process_set_reduces_within_the_set():
    if SIZE == 1:
        return
    members = list(range(0, SIZE, 2))
    even = kd.add_process_set(members)
    try:
        seed = 40
        start = start_values(seed)
        variables = variables_from(start)
        optimizer = kd.DistributedOptimizer(keras.optimizers.SGD(LR), process_set=even)
        before = COUNTERS["allreduce"]
        one_step(optimizer, variables, seed)
        inside = RANK in members
        made = COUNTERS["allreduce"] - before
        assert made == (1 if inside and len(members) > 1 else 0), made
        grads = mean_over(members, seed) if inside else grads_of(RANK, seed)
        close([v.numpy() for v in variables], [w - LR * g for w, g in zip(start, grads)],
              "process set")
        same_on_every_rank([v.numpy() for v in variables], "process set", members)
    finally:
        kd.remove_process_set(even)


def test_broadcast_callback_leaves_local_variables():
    root = SIZE - 1
    constant = keras.initializers.Constant(float(RANK))
    model = keras.Sequential([keras.Input((3,))] + [
        keras.layers.Dense(3, kernel_initializer=constant, bias_initializer=constant,
                           trainable=False) for _ in range(3)])
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse")
    local = list(model.layers[0].weights)
    callback = kd.callbacks.BroadcastGlobalVariablesCallback(root, local_variables=local)
    model.fit(np.ones((2, 3)), np.ones((2, 3)), epochs=1, verbose=0, callbacks=[callback])
    for variable in model.weights:
        want = float(RANK) if any(variable is v for v in local) else float(root)
        np.testing.assert_array_equal(np.asarray(variable), np.full(variable.shape, want),
                                      err_msg=variable.path)


if __name__ == "__main__":
    run_checks([function for name, function in list(globals().items())
                if name.startswith("test_")],
               rank=RANK, passed="OPTOPTS {name} passed rank={rank}", agree=kd.allgather_object)
