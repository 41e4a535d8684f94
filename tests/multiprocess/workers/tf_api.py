"""The TensorFlow API as Horovod's users call it, on every rank, checked against numpy.

Gradients of the collectives (eager tape, ``tf.function``, TF1 graph with
``tf.gradients``), the TF error classes, the legacy ``average=`` flag,
Horovod's integer scaling, ``IndexedSlices``, in-place broadcasts, and
``process_set=None``. Each rank draws its data from a generator seeded by
(case, rank), so every rank computes every reference itself in float64.
Prints "SUITE test_x passed rank=R" per test and "TF API OK rank=R size=N".
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras_dist as kd  # noqa: E402
from tests.multiprocess.workers._checks import run_checks  # noqa: E402
from tests.multiprocess.workers._inputs import data, in_graph, scaled  # noqa: E402

kd.init()
RANK, SIZE = kd.rank(), kd.size()


def close(label, got, want, rtol=1e-6):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{label}: shape {got.shape} != {want.shape}"
    assert np.allclose(got, want, rtol=rtol, atol=rtol), f"{label}: {got} != {want}"


# ---------------------------------------------------------------------------
# Gradients. With upstream gradient u on rank r, Horovod defines:
#   allreduce(op, pre, post): the same allreduce of u;
#   allgather: rank r's rows of Average(u);
#   broadcast(root): Average(u) on the root, zeros elsewhere.


def gradient_cases():
    """(label, forward(x), upstream(r), expected gradient on this rank(x))."""
    ups = {r: data(100, r, (4, 3)) for r in range(SIZE)}
    mean_up = np.mean([ups[r] for r in range(SIZE)], 0)
    rows = [r + 1 for r in range(SIZE)]  # ragged: rank r gives r + 1 rows
    gather_ups = {r: data(101, r, (sum(rows), 3)) for r in range(SIZE)}
    gather_mean = np.mean([gather_ups[r] for r in range(SIZE)], 0)
    start = sum(rows[:RANK])
    root = SIZE - 1
    total = np.sum([ups[r] for r in range(SIZE)], 0)
    return [
        ("allreduce Sum", (4, 3), lambda x: kd.allreduce(x, op=kd.Sum), ups, total),
        ("allreduce Average", (4, 3), lambda x: kd.allreduce(x, op=kd.Average), ups, mean_up),
        ("allreduce average=True pre/post", (4, 3),
         lambda x: kd.allreduce(x, average=True, prescale_factor=0.5, postscale_factor=3.0),
         ups, mean_up * 1.5),
        ("grouped_allreduce Sum", (4, 3),
         lambda x: kd.grouped_allreduce([x, x * 2.0], op=kd.Sum)[1], ups, 2.0 * total),
        ("allgather ragged", (RANK + 1, 3), lambda x: kd.allgather(x), gather_ups,
         gather_mean[start : start + RANK + 1]),
        ("broadcast", (4, 3), lambda x: kd.broadcast(x, root_rank=root), ups,
         mean_up if RANK == root else np.zeros((4, 3))),
    ]


def test_gradients_eager_function_and_graph():
    for case, (label, shape, forward, ups, expected) in enumerate(gradient_cases()):
        x0 = data(200 + case, RANK, shape)
        upstream = ups[RANK]

        variable = tf.Variable(x0)
        with tf.GradientTape() as tape:
            y = forward(variable)
        close(f"eager tape: {label}", tape.gradient(y, variable, upstream), expected)

        @tf.function
        def traced(x, u, forward=forward):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = forward(x)
            return tape.gradient(y, x, u)

        close(f"tf.function: {label}", traced(tf.constant(x0), tf.constant(upstream)), expected)

        def graph(forward=forward, x0=x0, upstream=upstream):
            x = tf.constant(x0)
            return tf.gradients(forward(x), x, tf.constant(upstream))[0]

        close(f"TF1 graph: {label}", in_graph(graph), expected)


def test_model_parallel_tape_in_function():
    # alltoall inside a tf.function, through DistributedGradientTape with a local
    # source: rows 2j:2j+2 of rank r's x go to rank j, so with loss_j = sum(y_j * c_j)
    # the gradient of x_r's rows 2j:2j+2 is c_j's rows 2r:2r+2, not reduced but,
    # as Horovod scales local gradients by default, divided by the size.
    xs = [data(1200, r, (2 * SIZE, 3)) for r in range(SIZE)]
    cs = [data(1201, r, (2 * SIZE, 3)) for r in range(SIZE)]
    x = tf.Variable(xs[RANK])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            y = kd.alltoall(x)
            loss = tf.reduce_sum(y * cs[RANK])
        tape = kd.DistributedGradientTape(tape)
        tape.register_local_source(x)
        return tape.gradient(loss, [x])[0]

    want = np.concatenate([cs[j][2 * RANK:2 * RANK + 2] for j in range(SIZE)]) / SIZE
    close("model-parallel gradient", step(), want)


def test_second_order_gradient():
    # The gradient is itself a collective with a gradient: with the upstream
    # gradient x_r, d allreduce_sum / dx is sum_r x_r, whose derivative is SIZE.
    x0 = data(300, RANK, (5,))
    variable = tf.Variable(x0)
    with tf.GradientTape() as outer:
        with tf.GradientTape() as inner:
            y = kd.allreduce(variable, op=kd.Sum)
        g = inner.gradient(y, variable, output_gradients=variable * 1.0)
    close("gradient of allreduce", g, np.sum([data(300, r, (5,)) for r in range(SIZE)], 0))
    close("its gradient", outer.gradient(g, variable), np.full(5, float(SIZE)))


# ---------------------------------------------------------------------------
# Horovod's reduction semantics.


def test_legacy_average_flag():
    inputs = [data(400, r, (6,)) for r in range(SIZE)]
    close("average=True", kd.allreduce(tf.constant(inputs[RANK]), average=True),
          np.mean(inputs, 0))
    close("average=False", kd.allreduce(inputs[RANK], average=False), np.sum(inputs, 0))
    grouped = kd.grouped_allreduce([inputs[RANK]], average=False)
    close("grouped average=False", grouped[0], np.sum(inputs, 0))
    for error in (ValueError, tf.errors.InvalidArgumentError):
        try:
            kd.allreduce(tf.constant(inputs[RANK]), op=kd.Sum, average=True)
        except error as caught:
            assert "not both" in str(caught), caught
        else:
            raise AssertionError("op and average together were accepted")


def test_integer_and_half_scaling():
    factor = 0.1915194503788923
    for case, dtype in enumerate([np.uint8, np.int32, np.int64, np.float16, np.float32]):
        low, high = (0, 100 // SIZE) if dtype == np.uint8 else (-100, 100)
        # Floats: the same values on every rank, so that the sum rounds once and
        # the reference is exact (as in Horovod's own tests).
        owners = range(SIZE) if np.dtype(dtype).kind in "iu" else [0] * SIZE
        inputs = [data(500 + case, r, (17, 3), dtype, low, high) for r in owners]
        wide = np.int64 if np.dtype(dtype).kind in "iu" else np.float64
        pre = np.sum([scaled(i, factor, dtype).astype(wide) for i in inputs], 0).astype(dtype)
        post = scaled(np.sum([i.astype(wide) for i in inputs], 0).astype(dtype), factor, dtype)
        for label, kwargs, want in (("prescale", {"prescale_factor": factor}, pre),
                                    ("postscale", {"postscale_factor": factor}, post)):
            for kind, value in (("numpy", inputs[RANK]), ("tf", tf.constant(inputs[RANK]))):
                got = np.asarray(kd.allreduce(value, op=kd.Sum, **kwargs))
                assert got.dtype == dtype, f"{label} {kind} {dtype}: dtype {got.dtype}"
                assert np.array_equal(got, want), f"{label} {kind} {np.dtype(dtype).name} differs"
            fused = kd.grouped_allreduce([inputs[RANK], inputs[RANK]], op=kd.Sum, **kwargs)
            assert all(np.array_equal(f, want) for f in fused), f"fused {label} {dtype} differs"


def test_indexed_slices():
    for case, dense_shape in enumerate((None, (SIZE + 1, 4))):
        values = [data(600 + case, r, (2, 4)) for r in range(SIZE)]
        indices = [np.array([r, r + 1], np.int64) for r in range(SIZE)]
        shape = None if dense_shape is None else tf.constant(dense_shape, tf.int64)

        def slices(shape=shape, values=values, indices=indices):
            return tf.IndexedSlices(tf.constant(values[RANK]), tf.constant(indices[RANK]), shape)

        for op, divide in ((kd.Sum, 1), (kd.Average, SIZE)):
            result = kd.allreduce(slices(), op=op)
            assert isinstance(result, tf.IndexedSlices), type(result)
            close(f"IndexedSlices {op} values", result.values, np.concatenate(values) / divide)
            assert np.array_equal(result.indices.numpy(), np.concatenate(indices))
            assert (result.dense_shape is None) == (dense_shape is None)
            got = in_graph(lambda op=op: kd.grouped_allreduce([slices(), tf.ones(2)], op=op)[0]
                           .values)
            close(f"TF1 graph IndexedSlices {op}", got, np.concatenate(values) / divide)
    for bad in ({"op": kd.Min}, {"op": kd.Sum, "postscale_factor": 2.0}):
        try:
            kd.allreduce(slices(), **bad)
        except NotImplementedError as error:
            assert "IndexedSlices" in str(error), error
        else:
            raise AssertionError(f"IndexedSlices with {bad} was accepted")


# ---------------------------------------------------------------------------
# Broadcasts in place, bools, process_set=None, the graph ops.


def test_broadcast_in_place():
    for root in range(SIZE):
        values = [data(700 + root, r, (3, 2), np.float32) for r in range(SIZE)]
        flags = [data(750 + root, r, (5,), bool) for r in range(SIZE)]
        variables = [tf.Variable(values[RANK]), tf.Variable(flags[RANK])]
        out = kd.broadcast_(variables, root_rank=root)
        assert np.array_equal(variables[0].numpy(), values[root])
        assert np.array_equal(variables[1].numpy(), flags[root])
        assert np.array_equal(out[1].numpy(), flags[root]) and out[1].dtype == tf.bool

        variable = tf.Variable(values[RANK])
        got = tf.function(lambda v=variable, root=root: kd.broadcast_([v], root)[0])()
        assert np.array_equal(got.numpy(), values[root])
        assert np.array_equal(variable.numpy(), values[root])

        for make in (tf.compat.v1.Variable, lambda v: tf.compat.v1.Variable(v, use_resource=False)):
            with tf.Graph().as_default(), tf.compat.v1.Session() as session:
                variable = make(values[RANK])
                broadcast = kd.broadcast_([variable], root)[0]
                session.run(tf.compat.v1.global_variables_initializer())
                assert np.array_equal(session.run(broadcast), values[root]), "TF1 broadcast_"
                assert np.array_equal(session.run(variable), values[root]), "TF1 variable"


def test_broadcast_global_variables():
    try:
        kd.broadcast_global_variables(0)
    except RuntimeError as error:
        assert "broadcast_variables" in str(error), error
    else:
        raise AssertionError("broadcast_global_variables ran eagerly")
    values = [data(800, r, (4,)) for r in range(SIZE)]
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        variable = tf.compat.v1.Variable(values[RANK])
        session.run(tf.compat.v1.global_variables_initializer())
        session.run(kd.broadcast_global_variables(SIZE - 1))
        assert np.array_equal(session.run(variable), values[SIZE - 1])


def test_bools_and_process_set_none():
    flags = [data(900, r, (r + 2, 3), bool) for r in range(SIZE)]
    gathered = kd.allgather(tf.constant(flags[RANK]), process_set=None)
    assert gathered.dtype == tf.bool
    assert np.array_equal(gathered.numpy(), np.concatenate(flags))
    assert np.array_equal(kd.allgather(flags[RANK]), np.concatenate(flags))
    same_shape = [data(902, r, (4,), bool) for r in range(SIZE)]
    assert np.array_equal(kd.broadcast(same_shape[RANK], 0, process_set=None), same_shape[0])
    inputs = [data(901, r, (3,)) for r in range(SIZE)]
    close("process_set=None", kd.allreduce(inputs[RANK], op=kd.Sum, process_set=None),
          np.sum(inputs, 0))
    assert kd.allgather_object(RANK, process_set=None) == list(range(SIZE))
    assert kd.broadcast_object(RANK, root_rank=0, process_set=None) == 0
    kd.barrier(process_set=None)
    size, rank = kd.size_op(process_set_id=0), kd.rank_op(0)
    assert (int(size), int(rank)) == (SIZE, RANK)
    assert in_graph(lambda: [kd.size_op(), kd.rank_op()]) == [SIZE, RANK]


def test_traced_grouped_allreduce_mixed_shapes_and_dtypes():
    # A traced step's results up to 64 KiB leave the host call as one buffer,
    # sliced apart in the graph; larger ones travel on their own. Every kind
    # here, exact against float64 references on every rank.
    specs = [((64, 64), np.float32), ((129, 257), np.float32), ((7,), np.float32),
             ((33,), np.float16), ((5, 3), np.float64), ((10,), np.int32), ((0,), np.float32),
             ((), np.float32), ((2000,), np.float32), ((3, 3, 2, 8), np.float32),
             ((300, 70), np.float64), ((6,), np.int64)]
    inputs = {r: [data(700 + i, r, shape, dtype) for i, (shape, dtype) in enumerate(specs)]
              for r in range(SIZE)}

    @tf.function
    def step(*xs):
        return kd.grouped_allreduce([x * 1 for x in xs], op=kd.Sum)

    for attempt in range(2):  # the second call reuses the pooled buffer
        got = step(*[tf.constant(x) for x in inputs[RANK]])
        for i, ((shape, dtype), result) in enumerate(zip(specs, got)):
            want = np.sum([inputs[r][i].astype(np.float64) for r in range(SIZE)], 0)
            assert result.shape == shape and result.dtype == tf.as_dtype(dtype), \
                f"traced grouped tensor {i}: {result.shape} {result.dtype}"
            close(f"traced grouped tensor {i} {shape} {np.dtype(dtype).name} call {attempt}",
                  result.numpy(), want.astype(dtype), rtol=1e-3 if dtype == np.float16 else 1e-6)
    averaged = tf.function(lambda *xs: kd.grouped_allreduce(list(xs), op=kd.Average))(
        *[tf.constant(x) for x in inputs[RANK][:3]])
    for i, result in enumerate(averaged):
        want = np.mean([inputs[r][i].astype(np.float64) for r in range(SIZE)], 0)
        close(f"traced grouped Average {i}", result.numpy(), want, rtol=1e-5)


def test_graph_collectives_run_in_build_order():
    # A session runs independent ops in any order; the collectives of a TF1
    # graph must still run in the order they were built, the same on every rank.
    cases = [(1100 + i, (i % 5 + 1, 3), [np.float32, np.float64, np.int32][i % 3])
             for i in range(24)]
    inputs = [[data(case, r, shape, dtype) for r in range(SIZE)] for case, shape, dtype in cases]

    def build():
        outputs = []
        for i, per_rank in enumerate(inputs):
            x = tf.constant(per_rank[RANK])
            kind = i % 3
            outputs.append(kd.allreduce(x, op=kd.Sum) if kind == 0 else
                           kd.allgather(x) if kind == 1 else kd.broadcast(x, i % SIZE))
        return outputs

    for i, got in enumerate(in_graph(build)):
        per_rank = inputs[i]
        want = (np.sum(per_rank, 0) if i % 3 == 0 else
                np.concatenate(per_rank) if i % 3 == 1 else per_rank[i % SIZE])
        close(f"graph collective {i}", got, want)


def test_queries():
    # KERAS_DIST_RANKS_PER_NODE splits this machine into virtual ones of that many ranks.
    per_node = int(os.environ.get("KERAS_DIST_RANKS_PER_NODE") or 0)
    assert kd.is_homogeneous() is (not per_node or SIZE % per_node == 0 or SIZE < per_node)
    assert int(kd.process_set_included_op(0)) == 1
    assert in_graph(lambda: kd.process_set_included_op()) == 1
    assert kd.broadcast_object_fn(root_rank=SIZE - 1)({"rank": RANK}) == {"rank": SIZE - 1}
    expect("unknown process set", lambda: kd.process_set_included_op(7), ValueError,
           text="not registered")


# ---------------------------------------------------------------------------
# Errors: a TF caller gets TF's classes, which are also keras_dist's.


def expect(label, call, *classes, text=""):
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the class is what is checked
        assert all(isinstance(error, c) for c in classes), \
            f"{label}: {type(error).__mro__} is not all of {classes}: {error}"
        assert text in str(error), f"{label}: {text!r} not in {error}"
    else:
        raise AssertionError(f"{label}: raised nothing")


def test_argument_errors_are_tf_errors():
    x = tf.ones(3)
    expect("root_rank out of range", lambda: kd.broadcast(x, SIZE), ValueError,
           tf.errors.InvalidArgumentError, text="root_rank")
    expect("op string", lambda: kd.allreduce(x, op="sum"), ValueError,
           tf.errors.InvalidArgumentError, text="`op`")
    expect("IndexedSlices op", lambda: kd.allreduce(tf.IndexedSlices(x, tf.constant([0, 1, 2])),
                                                    op=kd.Product),
           NotImplementedError, tf.errors.UnimplementedError, text="IndexedSlices")
    # A numpy caller keeps the plain Python classes.
    try:
        kd.broadcast(np.ones(3), SIZE)
    except ValueError as error:
        assert not isinstance(error, tf.errors.OpError), type(error).__mro__


def test_mismatches_are_failed_preconditions():
    # Last: a mismatch must leave the group usable, checked by the final allreduce.
    if SIZE == 1:
        return
    classes = (kd.CollectiveMismatchError, tf.errors.FailedPreconditionError)
    shape = (17 + RANK, 3)
    expect("eager allreduce shapes", lambda: kd.allreduce(tf.ones(shape)), *classes)
    expect("eager allgather shapes", lambda: kd.allgather(tf.ones((2, 3 + RANK))), *classes,
           text="same shape past the first dimension")
    expect("tf.function allreduce dtypes",
           lambda: tf.function(kd.allreduce)(tf.ones(4, tf.float32 if RANK else tf.float64)),
           tf.errors.FailedPreconditionError, text="CollectiveMismatchError")
    expect("TF1 graph broadcast roots",
           lambda: in_graph(lambda: kd.broadcast(tf.ones(3), RANK)),
           tf.errors.FailedPreconditionError, text="CollectiveMismatchError")
    inputs = [data(1000, r, (5,)) for r in range(SIZE)]
    close("allreduce after the mismatches", kd.allreduce(tf.constant(inputs[RANK]), op=kd.Sum),
          np.sum(inputs, 0))


if __name__ == "__main__":
    run_checks([function for name, function in list(globals().items())
                if name.startswith("test_")],
               rank=RANK, passed="SUITE {name} passed rank={rank}", agree=kd.allgather_object)
    print(f"TF API OK rank={RANK} size={SIZE}", flush=True)
