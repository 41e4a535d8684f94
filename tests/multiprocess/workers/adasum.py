"""allreduce / grouped_allreduce with op=Adasum on every rank.

Each rank draws every rank's data from generators seeded by (case, rank) and
computes the expected Adasum itself in float64 numpy (its own pairwise
formula and tree, not the package's). At a power-of-2 size: numpy and TF
values (eager, ``tf.function``, TF1 graph), groups of mixed dtypes, scaling,
gradients, DistributedOptimizer and DistributedGradientTape, the argument
errors and a shape mismatch. At any other size: the NotImplementedError on
every rank (numpy only, no TF import), and the group still works after it.
ADASUM_TESTS (comma-separated names) runs a subset.
Prints "ADASUM test_x passed rank=R" per test and "ADASUM OK rank=R size=N".
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import keras_dist as kd  # noqa: E402
from tests.multiprocess.workers._checks import run_checks  # noqa: E402

kd.init(process_sets="dynamic")
RANK, SIZE = kd.rank(), kd.size()
POWER_OF_2 = SIZE & (SIZE - 1) == 0


def data(case, rank, shape, dtype=np.float64):
    """Rank ``rank``'s random input for ``case`` (never all zeros)."""
    return np.random.default_rng([case, rank]).uniform(-2.0, 2.0, shape).astype(dtype)


def pair(a, b):
    """The Adasum of two flat float64 vectors, zero vectors kept as they are."""
    dot = float(np.sum(a * b))
    na, nb = float(np.sum(a * a)), float(np.sum(b * b))
    return (a * (1.0 if na == 0 else 1.0 - dot / (2 * na))
            + b * (1.0 if nb == 0 else 1.0 - dot / (2 * nb)))


def reference(per_rank, prescale=1.0, postscale=1.0):
    """Every rank's arrays combined by recursive doubling, in float64."""
    level = [np.asarray(x, np.float64).ravel() * prescale for x in per_rank]
    while len(level) > 1:
        level = [pair(level[2 * i], level[2 * i + 1]) for i in range(len(level) // 2)]
    return (level[0] * postscale).reshape(np.shape(per_rank[0]))


def same(label, got, want, dtype):
    got = np.asarray(got)
    assert got.dtype == np.dtype(dtype), f"{label}: dtype {got.dtype} != {np.dtype(dtype)}"
    assert got.shape == want.shape, f"{label}: shape {got.shape} != {want.shape}"
    tol = {2: 1e-2, 4: 1e-5, 8: 1e-12}[np.dtype(dtype).itemsize]
    assert np.allclose(got.astype(np.float64), want, rtol=tol, atol=tol), \
        f"{label}: {got} != {want}"


def identical_everywhere(label, array):
    blobs = kd.allgather_object(np.asarray(array).tobytes())
    assert all(b == blobs[0] for b in blobs), f"{label}: ranks differ"


def expect(label, call, cls, text):
    try:
        call()
    except cls as error:
        assert text in str(error), f"{label}: {text!r} not in {error}"
    else:
        raise AssertionError(f"{label}: raised no {cls.__name__}")


def test_numpy_allreduce():
    for case, (shape, dtype) in enumerate([((3, 4), np.float32), ((5,), np.float64),
                                           ((), np.float64), ((2, 3), np.float16),
                                           ((0, 2), np.float32)]):
        inputs = [data(case, r, shape, dtype) for r in range(SIZE)]
        got = kd.allreduce(inputs[RANK], op=kd.Adasum)
        same(f"numpy {dtype.__name__}{shape}", got, reference(inputs), dtype)
        identical_everywhere(f"numpy {shape}", got)


def test_zero_tensor_on_one_rank():
    inputs = [data(10, r, (6,)) for r in range(SIZE)]
    inputs[SIZE - 1] = np.zeros(6)
    got = kd.allreduce(inputs[RANK], op=kd.Adasum, prescale_factor=0.5, postscale_factor=3.0)
    same("zero norm, scaled", got, reference(inputs, 0.5, 3.0), np.float64)


def test_grouped_allreduce():
    specs = [((2, 2), np.float32), ((3,), np.float64), ((4,), np.float16), ((2, 2), np.float32)]
    inputs = [[data(20 + i, r, shape, dtype) for r in range(SIZE)]
              for i, (shape, dtype) in enumerate(specs)]
    got = kd.grouped_allreduce([x[RANK] for x in inputs], op=kd.Adasum, postscale_factor=2.0)
    for i, (_, dtype) in enumerate(specs):
        same(f"grouped {i}", got[i], reference(inputs[i], postscale=2.0), dtype)


def test_tensorflow():
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    a = [data(30, r, (3, 2), np.float32) for r in range(SIZE)]
    b = [data(31, r, (4,), np.float64) for r in range(SIZE)]
    eager = kd.allreduce(tf.constant(a[RANK]), op=kd.Adasum)
    assert isinstance(eager, tf.Tensor)
    same("tf eager", eager.numpy(), reference(a), np.float32)
    traced = tf.function(lambda x, y: kd.grouped_allreduce([x, y], op=kd.Adasum))(
        tf.constant(a[RANK]), tf.constant(b[RANK]))
    same("tf.function 0", traced[0].numpy(), reference(a), np.float32)
    same("tf.function 1", traced[1].numpy(), reference(b), np.float64)
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        graph = session.run(kd.allreduce(tf.constant(b[RANK]), op=kd.Adasum,
                                         prescale_factor=2.0))
    same("TF1 graph", graph, reference(b, prescale=2.0), np.float64)


def test_gradient():
    import tensorflow as tf

    # d/dx sum(w * adasum(x)) is the Adasum of every rank's w.
    x = [data(40, r, (5,)) for r in range(SIZE)]
    w = [data(41, r, (5,)) for r in range(SIZE)]
    variable = tf.Variable(x[RANK])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.constant(w[RANK]) * kd.allreduce(variable, op=kd.Adasum))
    same("gradient", tape.gradient(loss, variable).numpy(), reference(w), np.float64)


def test_distributed_optimizer_and_tape():
    import keras
    import tensorflow as tf

    grads = [[data(50 + i, r, shape) for r in range(SIZE)]
             for i, shape in enumerate([(3,), (2, 2)])]
    start = [data(60, 0, (3,)), data(61, 0, (2, 2))]
    variables = [keras.Variable(s.astype(np.float32)) for s in start]
    optimizer = kd.DistributedOptimizer(keras.optimizers.SGD(0.5), op=kd.Adasum)
    optimizer.apply([tf.constant(g[RANK], tf.float32) for g in grads], variables)
    for i, v in enumerate(variables):
        same(f"optimizer variable {i}", v.numpy(), start[i] - 0.5 * reference(grads[i]),
             np.float32)
    x = tf.Variable(data(70, RANK, (4,)))
    w = [data(71, r, (4,)) for r in range(SIZE)]
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.constant(w[RANK]) * x)
    tape = kd.DistributedGradientTape(tape, op=kd.Adasum)
    same("DistributedGradientTape", tape.gradient(loss, x).numpy(), reference(w), np.float64)


def test_argument_errors():
    import tensorflow as tf

    expect("int dtype", lambda: kd.allreduce(np.arange(4, dtype=np.int32), op=kd.Adasum),
           TypeError, "Received: dtype=int32")
    slices = tf.IndexedSlices(tf.constant(data(80, RANK, (2, 3))), tf.constant([0, 2]),
                              tf.constant([4, 3]))
    expect("IndexedSlices", lambda: kd.allreduce(slices, op=kd.Adasum),
           NotImplementedError, "IndexedSlices")
    expect("grouped IndexedSlices",
           lambda: kd.grouped_allreduce([np.ones(2), slices], op=kd.Adasum),
           NotImplementedError, "IndexedSlices")
    if SIZE == 1:  # a set of every rank would be the global one
        return
    first = kd.add_process_set([0])
    try:
        if RANK == 0:
            expect("process set", lambda: kd.allreduce(np.ones(2), op=kd.Adasum,
                                                       process_set=first),
                   NotImplementedError, "global process set only")
    finally:
        kd.remove_process_set(first)


def test_shape_mismatch():
    # Last: every rank raises, and the group still works after it.
    if SIZE == 1:
        return
    shape = (3, 2) if RANK == 0 else (2, 3)
    expect("shape mismatch", lambda: kd.allreduce(np.ones(shape), op=kd.Adasum),
           kd.CollectiveMismatchError, "same dtype and the same shape")
    inputs = [data(90, r, (3,)) for r in range(SIZE)]
    same("after mismatch", kd.allreduce(inputs[RANK], op=kd.Adasum), reference(inputs),
         np.float64)


def test_not_power_of_2():
    expect("numpy", lambda: kd.allreduce(data(95, RANK, (3,)), op=kd.Adasum),
           NotImplementedError, f"power-of-2 number of ranks (1, 2, 4, 8, ...). "
           f"Received: size={SIZE}")
    expect("grouped", lambda: kd.grouped_allreduce([np.ones(2)], op=kd.Adasum),
           NotImplementedError, "power-of-2")
    total = kd.allreduce(np.full(2, RANK + 1.0), op=kd.Sum)
    assert np.array_equal(total, np.full(2, SIZE * (SIZE + 1) / 2)), total


if __name__ == "__main__":
    # ADASUM_TESTS: the tests to run, comma-separated (default: all that apply).
    chosen = os.environ.get("ADASUM_TESTS")
    tests = [test_not_power_of_2] if not POWER_OF_2 else [
        function for name, function in list(globals().items())
        if name.startswith("test_") and name != "test_not_power_of_2"
        and (chosen is None or name in chosen.split(","))]
    run_checks(tests, rank=RANK, passed="ADASUM {name} passed rank={rank}",
               agree=kd.allgather_object)
    print(f"ADASUM OK rank={RANK} size={SIZE}", flush=True)
