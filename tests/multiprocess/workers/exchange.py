"""alltoall, reducescatter, grouped_allgather and grouped_reducescatter on every rank.

Each rank draws every rank's data from generators seeded by (case, rank), so
it computes every reference itself in float64 numpy. Covers numpy and TF
values (eager, ``tf.function``, TF1 graph), ragged splits, a rank sending or
receiving nothing, empty inputs, uneven scatters, scaling, gradients, the
argument errors with their exact messages, and mismatches between ranks
(last: the group must stay usable after them).
Prints "EXCHANGE test_x passed rank=R" per test and "EXCHANGE OK rank=R size=N".
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
DTYPES = [np.uint8, np.int32, np.int64, np.float16, np.float32, np.float64]


def splits_matrix(case, rows_max=3):
    """matrix[r, k]: rows rank r sends to rank k, the same on every rank."""
    return np.random.default_rng([case, 99]).integers(0, rows_max + 1, (SIZE, SIZE))


def same(label, got, want, dtype=None, rtol=0.0):
    got, want = np.asarray(got), np.asarray(want)
    if dtype is not None:
        assert got.dtype == np.dtype(dtype), f"{label}: dtype {got.dtype} != {np.dtype(dtype)}"
    assert got.shape == want.shape, f"{label}: shape {got.shape} != {want.shape}"
    got64, want64 = got.astype(np.float64), want.astype(np.float64)
    assert np.allclose(got64, want64, rtol=rtol, atol=rtol), f"{label}: {got} != {want}"


def expect(label, call, *classes, text=""):
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the class is what is checked
        assert all(isinstance(error, c) for c in classes), \
            f"{label}: {type(error).__mro__} is not all of {classes}: {error}"
        assert text in str(error), f"{label}: {text!r} not in {error}"
    else:
        raise AssertionError(f"{label}: raised nothing")


# ---------------------------------------------------------------------------
# alltoall


def alltoall_reference(matrix, inputs):
    """Rows rank RANK receives, in rank order, and how many from each."""
    pieces = []
    for r in range(SIZE):
        start = int(matrix[r, :RANK].sum())
        pieces.append(inputs[r][start : start + matrix[r, RANK]])
    return np.concatenate(pieces), matrix[:, RANK]


def alltoall_cases():
    """(label, matrix, extra rows past sum(splits)) for ragged splits."""
    ragged = splits_matrix(1)
    sends_nothing = splits_matrix(2)
    sends_nothing[SIZE - 1, :] = 0
    receives_nothing = splits_matrix(3)
    receives_nothing[:, 0] = 0
    return [("ragged", ragged, 0), ("ragged with unsent rows", ragged, 2),
            ("a rank sends nothing", sends_nothing, 0),
            ("rank 0 receives nothing", receives_nothing, 0),
            ("nothing at all", np.zeros((SIZE, SIZE), np.int64), 0)]


def test_alltoall_numpy_splits():
    for case, (label, matrix, extra) in enumerate(alltoall_cases()):
        for dtype_case, dtype in enumerate(DTYPES):
            for dims in ((), (2,), (2, 3)):
                inputs = [data(100 + case * 10 + dtype_case, r,
                               (matrix[r].sum() + extra, *dims), dtype) for r in range(SIZE)]
                want, want_splits = alltoall_reference(matrix, inputs)
                got, got_splits = kd.alltoall(inputs[RANK], matrix[RANK].tolist())
                tag = f"alltoall {label} {np.dtype(dtype).name}{list(dims)}"
                same(tag, got, want, dtype)
                same(f"{tag} splits", got_splits, want_splits, np.int32)


def test_alltoall_numpy_equal_split():
    for case, dtype in enumerate(DTYPES + [bool]):
        rows = 2 * SIZE
        inputs = [data(200 + case, r, (rows, 3), dtype) for r in range(SIZE)]
        want = np.concatenate([inputs[r][2 * RANK : 2 * RANK + 2] for r in range(SIZE)])
        got = kd.alltoall(inputs[RANK])
        assert isinstance(got, np.ndarray), type(got)  # no splits given: the rows alone
        same(f"alltoall equal {np.dtype(dtype).name}", got, want, dtype)
    empty = kd.alltoall(np.zeros((0, 4), np.float32))
    assert empty.shape == (0, 4) and empty.dtype == np.float32, empty


def test_alltoall_tf_eager_function_graph():
    matrix = splits_matrix(300)
    inputs = [data(300, r, (matrix[r].sum(), 2), np.float32) for r in range(SIZE)]
    want, want_splits = alltoall_reference(matrix, inputs)
    splits = tf.constant(matrix[RANK], tf.int32)
    got, got_splits = kd.alltoall(tf.constant(inputs[RANK]), splits)
    assert isinstance(got, tf.Tensor) and got_splits.dtype == tf.int32
    same("tf eager", got, want, np.float32)
    same("tf eager splits", got_splits, want_splits, np.int32)
    function = tf.function(lambda x, s: kd.alltoall(x, s))
    got, got_splits = function(tf.constant(inputs[RANK]), splits)
    same("tf.function", got, want, np.float32)
    same("tf.function splits", got_splits, want_splits, np.int32)
    got, got_splits = in_graph(lambda: kd.alltoall(tf.constant(inputs[RANK]),
                                                   tf.constant(matrix[RANK], tf.int64)))
    same("TF1 graph", got, want, np.float32)
    same("TF1 graph splits", got_splits, want_splits, np.int32)
    equal = [data(301, r, (SIZE, 2)) for r in range(SIZE)]
    got = in_graph(lambda: kd.alltoall(tf.constant(equal[RANK])))
    same("TF1 graph equal split", got, np.stack([equal[r][RANK] for r in range(SIZE)]))


def test_alltoall_gradients():
    # The gradient returns each received row's upstream gradient to its sender:
    # rank RANK's row sent to rank k gets u_k's row for it; unsent rows get 0.
    matrix = splits_matrix(400)
    extra = 1
    rows = [matrix[r].sum() for r in range(SIZE)]
    ups = {k: data(401, k, (matrix[:, k].sum(), 3)) for k in range(SIZE)}
    expected = []
    for k in range(SIZE):
        start = int(matrix[:RANK, k].sum())
        expected.append(ups[k][start : start + matrix[RANK, k]])
    expected = np.concatenate(expected + [np.zeros((extra, 3))])
    x0 = data(402, RANK, (rows[RANK] + extra, 3))
    splits = matrix[RANK].tolist()

    variable = tf.Variable(x0)
    with tf.GradientTape() as tape:
        received, _ = kd.alltoall(variable, splits)
    same("eager tape", tape.gradient(received, variable, tf.constant(ups[RANK])), expected,
         rtol=1e-12)

    @tf.function
    def traced(x, u):
        with tf.GradientTape() as tape:
            tape.watch(x)
            received, _ = kd.alltoall(x, splits)
        return tape.gradient(received, x, u)

    same("tf.function", traced(tf.constant(x0), tf.constant(ups[RANK])), expected, rtol=1e-12)

    def graph():
        x = tf.constant(x0)
        return tf.gradients(kd.alltoall(x, splits)[0], x, tf.constant(ups[RANK]))[0]

    same("TF1 graph", in_graph(graph), expected, rtol=1e-12)


# ---------------------------------------------------------------------------
# reducescatter


def own_rows(rows):
    base, extra = divmod(rows, SIZE)
    begin = RANK * base + min(RANK, extra)
    return begin, begin + base + (RANK < extra)


def reduced(inputs, op, dtype):
    """The reduction of ``inputs`` in float64 (integers: exact, Average rounded down)."""
    if np.dtype(dtype).kind in "iu":
        total = np.sum([i.astype(np.int64) for i in inputs], 0)
        return (total // SIZE if op is kd.Average else total).astype(dtype)
    total = np.sum([i.astype(np.float64) for i in inputs], 0)
    return total / SIZE if op is kd.Average else total


def tolerance(dtype):
    return {np.float16: 0.05, np.float32: 1e-4}.get(dtype, 1e-9)


def test_reducescatter_numpy():
    # Row counts: even, uneven (first ranks one more), fewer than the ranks, none.
    for rows in (3 * SIZE, 3 * SIZE + SIZE // 2 + 1, SIZE - 1, 0):
        for op in (kd.Sum, kd.Average):
            for case, dtype in enumerate(DTYPES[1:]):  # uint8 sums overflow
                inputs = [data(500 + rows + case, r, (rows, 2), dtype) for r in range(SIZE)]
                begin, end = own_rows(rows)
                want = reduced(inputs, op, dtype)[begin:end]
                got = kd.reducescatter(inputs[RANK], op=op)
                same(f"reducescatter {rows} rows {op} {np.dtype(dtype).name}", got, want, dtype,
                     tolerance(dtype))


def test_reducescatter_scaling_and_tf():
    factor = 0.1915194503788923
    rows = 2 * SIZE + 1
    begin, end = own_rows(rows)
    for case, dtype in enumerate([np.int32, np.int64, np.float16, np.float32]):
        owners = range(SIZE) if np.dtype(dtype).kind in "iu" else [0] * SIZE
        inputs = [data(600 + case, r, (rows, 3), dtype, -100, 100) for r in owners]
        wide = np.int64 if np.dtype(dtype).kind in "iu" else np.float64
        pre = np.sum([scaled(i, factor, dtype).astype(wide) for i in inputs], 0).astype(dtype)
        post = scaled(np.sum([i.astype(wide) for i in inputs], 0).astype(dtype), factor, dtype)
        for label, kwargs, want in (("prescale", {"prescale_factor": factor}, pre),
                                    ("postscale", {"postscale_factor": factor}, post)):
            for kind, value in (("numpy", inputs[RANK]), ("tf", tf.constant(inputs[RANK]))):
                got = kd.reducescatter(value, op=kd.Sum, **kwargs)
                assert isinstance(got, tf.Tensor) == (kind == "tf"), type(got)
                same(f"{label} {kind} {np.dtype(dtype).name}", got, want[begin:end], dtype)
    inputs = [data(650, r, (rows, 2)) for r in range(SIZE)]
    want = reduced(inputs, kd.Average, np.float64)[begin:end]
    function = tf.function(lambda x: kd.reducescatter(x))
    got = function(tf.constant(inputs[RANK]))
    assert got.shape == (end - begin, 2), got.shape  # the static shape
    same("tf.function", got, want, np.float64, 1e-12)
    same("TF1 graph", in_graph(lambda: kd.reducescatter(tf.constant(inputs[RANK]))), want,
         np.float64, 1e-12)
    same("Keras variable", kd.reducescatter(tf.Variable(inputs[RANK])), want, np.float64, 1e-12)
    same("fp16 compression",
         kd.reducescatter(inputs[RANK], compression=kd.Compression.fp16), want, np.float64, 0.05)


def test_grouped_reducescatter():
    shapes = [(2 * SIZE + 1, 3), (SIZE, 2, 2), (1,), (0, 4)]
    for op in (kd.Sum, kd.Average):
        for dtypes in ([np.float64] * 4, [np.float32, np.int32, np.float64, np.int64]):
            inputs = [[data(700 + i, r, shape, dtype) for i, (shape, dtype)
                       in enumerate(zip(shapes, dtypes))] for r in range(SIZE)]
            got = kd.grouped_reducescatter(inputs[RANK], op=op)
            assert len(got) == len(shapes)
            for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
                begin, end = own_rows(shape[0])
                want = reduced([inputs[r][i] for r in range(SIZE)], op, dtype)[begin:end]
                same(f"grouped {op} {i} {np.dtype(dtype).name}", got[i], want, dtype,
                     tolerance(dtype))
            tf_got = kd.grouped_reducescatter([tf.constant(v) for v in inputs[RANK]], op=op)
            for i in range(len(shapes)):
                same(f"grouped tf {op} {i}", tf_got[i], got[i], dtypes[i])
    assert kd.grouped_reducescatter([]) == []


def test_reducescatter_gradients():
    # Horovod's definition: the allgather of the upstream gradients, times
    # SIZE for Sum, times prescale * postscale.
    rows = 2 * SIZE + 1
    ups = {r: data(800, r, (own_rows_of(rows, r), 3)) for r in range(SIZE)}
    gathered = np.concatenate([ups[r] for r in range(SIZE)])
    cases = [("Sum", lambda x: kd.reducescatter(x, op=kd.Sum), SIZE),
             ("Average pre/post", lambda x: kd.reducescatter(x, prescale_factor=0.5,
                                                              postscale_factor=3.0), 1.5),
             ("grouped Sum", lambda x: kd.grouped_reducescatter([x, x * 2.0], op=kd.Sum)[0],
              SIZE)]
    for label, forward, factor in cases:
        x0 = data(801, RANK, (rows, 3))
        variable = tf.Variable(x0)
        with tf.GradientTape() as tape:
            y = forward(variable)
        same(f"eager {label}", tape.gradient(y, variable, tf.constant(ups[RANK])),
             gathered * factor, rtol=1e-12)

        @tf.function
        def traced(x, u, forward=forward):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = forward(x)
            return tape.gradient(y, x, u)

        same(f"tf.function {label}", traced(tf.constant(x0), tf.constant(ups[RANK])),
             gathered * factor, rtol=1e-12)

        def graph(forward=forward, x0=x0):
            x = tf.constant(x0)
            return tf.gradients(forward(x), x, tf.constant(ups[RANK]))[0]

        same(f"TF1 graph {label}", in_graph(graph), gathered * factor, rtol=1e-12)


def own_rows_of(rows, rank):
    base, extra = divmod(rows, SIZE)
    return base + (rank < extra)


# ---------------------------------------------------------------------------
# grouped_allgather


def test_grouped_allgather():
    specs = [((2,), np.float64), ((3,), np.int32), ((), np.float32), ((2, 2), bool),
             ((0,), np.float16), ((4,), np.uint8)]
    inputs = [[data(900 + i, r, ((r + i) % 3, *dims) if dims != () else (), dtype)
               for i, (dims, dtype) in enumerate(specs)] for r in range(SIZE)]
    wants = [np.concatenate([np.atleast_1d(inputs[r][i]) for r in range(SIZE)])
             for i in range(len(specs))]
    got = kd.grouped_allgather(inputs[RANK])
    for i, (_, dtype) in enumerate(specs):
        same(f"grouped_allgather numpy {i}", got[i], wants[i], dtype)
    got = kd.grouped_allgather([tf.constant(v) for v in inputs[RANK]])
    for i, (_, dtype) in enumerate(specs):
        same(f"grouped_allgather tf {i}", got[i], wants[i], dtype)
    got = tf.function(kd.grouped_allgather)([tf.constant(v) for v in inputs[RANK]])
    for i, (_, dtype) in enumerate(specs):
        same(f"grouped_allgather tf.function {i}", got[i], wants[i], dtype)
    got = in_graph(lambda: kd.grouped_allgather([tf.constant(v) for v in inputs[RANK]]))
    for i, (_, dtype) in enumerate(specs):
        same(f"grouped_allgather TF1 graph {i}", got[i], wants[i], dtype)
    assert kd.grouped_allgather([]) == []
    single = kd.grouped_allgather([inputs[RANK][0]])
    same("one value", single[0], wants[0], np.float64)


def test_grouped_allgather_gradients():
    # As allgather's: this rank's rows of the average upstream gradient.
    rows = [r + 1 for r in range(SIZE)]
    ups = [{r: data(1000 + i, r, (sum(rows), 2)) for r in range(SIZE)} for i in range(2)]
    start = sum(rows[:RANK])
    expected = [np.mean([ups[i][r] for r in range(SIZE)], 0)[start : start + rows[RANK]]
                for i in range(2)]
    x0 = [data(1010 + i, RANK, (rows[RANK], 2)) for i in range(2)]
    variables = [tf.Variable(x) for x in x0]
    with tf.GradientTape() as tape:
        y = kd.grouped_allgather(variables)
    got = tape.gradient(y, variables, [tf.constant(ups[i][RANK]) for i in range(2)])
    for i in range(2):
        same(f"eager {i}", got[i], expected[i], rtol=1e-12)

    def graph():
        xs = [tf.constant(x) for x in x0]
        return tf.gradients(kd.grouped_allgather(xs), xs,
                            [tf.constant(ups[i][RANK]) for i in range(2)])

    got = in_graph(graph)
    for i in range(2):
        same(f"TF1 graph {i}", got[i], expected[i], rtol=1e-12)


# ---------------------------------------------------------------------------
# Errors


def test_argument_errors():
    x = np.ones((SIZE + 1, 2), np.float32)
    cases = [
        ("splits length", lambda: kd.alltoall(x, [1] * (SIZE + 1)),
         f"`splits` must be a vector of {SIZE} integers, one per rank. Received: "
         f"splits={[1] * (SIZE + 1)} (dtype=int64, shape=({SIZE + 1},))"),
        ("negative splits", lambda: kd.alltoall(x, [-1] + [1] * (SIZE - 1)),
         f"`splits` must not be negative. Received: splits={[-1] + [1] * (SIZE - 1)}"),
        ("splits past the rows", lambda: kd.alltoall(x, [SIZE + 2] + [0] * (SIZE - 1)),
         "`splits` must sum to at most the first dimension of `x`. Received: "
         f"splits={[SIZE + 2] + [0] * (SIZE - 1)} (sum {SIZE + 2}), x.shape=({SIZE + 1}, 2)"),
        ("float splits", lambda: kd.alltoall(x, [0.5] * SIZE),
         f"`splits` must be a vector of {SIZE} integers, one per rank. Received: "
         f"splits={[0.5] * SIZE} (dtype=float64, shape=({SIZE},))"),
        ("scalar alltoall", lambda: kd.alltoall(np.float32(1.0)),
         "`alltoall` needs `x` with at least one dimension (rows to split). "
         "Received: x.shape=()"),
        ("reducescatter Min", lambda: kd.reducescatter(x, op=kd.Min),
         "`reducescatter` supports op=Average and op=Sum. Received: op=ReduceOp.MIN"),
        ("reducescatter scalar", lambda: kd.reducescatter(np.float32(1.0)),
         "`reducescatter` needs values with at least one dimension (rows to scatter). "
         "Received: shape=() at position 0"),
        ("grouped_reducescatter scalar",
         lambda: kd.grouped_reducescatter([np.ones(2), np.float64(RANK)]),
         "`reducescatter` needs values with at least one dimension (rows to scatter). "
         "Received: shape=() at position 1"),
    ]
    if SIZE > 1:
        cases.append(("equal split of uneven rows", lambda: kd.alltoall(x),
                      "`x`'s first dimension must be a multiple of the number of ranks when "
                      f"`splits` is None. Received: x.shape=({SIZE + 1}, 2) (size={SIZE})"))
    for label, call, message in cases:
        expect(f"numpy {label}", call, ValueError, text=message)
    tf_x = tf.constant(x)
    expect("tf splits length", lambda: kd.alltoall(tf_x, [1] * (SIZE + 1)),
           ValueError, tf.errors.InvalidArgumentError, text="`splits` must be a vector")
    expect("tf reducescatter Min", lambda: kd.reducescatter(tf_x, op=kd.Min),
           ValueError, tf.errors.InvalidArgumentError, text="op=Average and op=Sum")
    expect("tf scalar reducescatter", lambda: kd.reducescatter(tf.constant(1.0)),
           ValueError, tf.errors.InvalidArgumentError, text="at least one dimension")
    expect("alltoall of strings", lambda: kd.alltoall(np.array(["a", "b"])), TypeError,
           text="`alltoall` supports booleans and numbers. Received: dtype=str32")
    expect("grouped_allgather of a tensor", lambda: kd.grouped_allgather(np.ones(2)),
           TypeError, text="`grouped_allgather` takes a list or tuple of tensors. "
           "Received: ndarray")


def test_mismatches():
    # Last: after each mismatch every rank has raised and the group still works.
    if SIZE == 1:
        return
    mismatch = (kd.CollectiveMismatchError,)
    expect("alltoall dtypes",
           lambda: kd.alltoall(np.ones((SIZE, 2), np.float32 if RANK else np.int32)),
           *mismatch, text="`alltoall` needs the same dtype and the same shape past the first "
           "dimension on every rank. Received: rank 0: shape=")
    expect("alltoall inner shapes", lambda: kd.alltoall(tf.ones((SIZE, 2 + RANK))), *mismatch,
           tf.errors.FailedPreconditionError, text="same shape past the first dimension")
    # Rank 1 alone passes invalid splits: it raises ValueError, the others a mismatch.
    splits = [1] * SIZE if RANK != 1 else [5] * SIZE
    if RANK == 1:
        expect("invalid splits here", lambda: kd.alltoall(np.ones((SIZE, 2)), splits),
               ValueError, text="`splits` must sum to at most the first dimension")
    else:
        expect("invalid splits on rank 1", lambda: kd.alltoall(np.ones((SIZE, 2)), splits),
               *mismatch, text="`alltoall` did not run: ranks [1] passed invalid arguments")
    expect("reducescatter shapes", lambda: kd.reducescatter(np.ones((4 + RANK, 2))), *mismatch)
    expect("reducescatter same count, other shapes",
           lambda: kd.reducescatter(tf.ones((4, 6) if RANK else (4, 2, 3))), *mismatch,
           tf.errors.FailedPreconditionError)
    expect("reducescatter dtypes",
           lambda: kd.reducescatter(np.ones(4, np.float32 if RANK else np.int32)), *mismatch)
    expect("grouped_allgather inner shapes",
           lambda: kd.grouped_allgather([np.ones(2), np.ones((1, 2 + RANK))]), *mismatch,
           text="Received at position 1: rank 0: shape=(1, 2) dtype=float64, "
           "rank 1: shape=(1, 3) dtype=float64")
    expect("grouped_allgather counts",
           lambda: kd.grouped_allgather([np.ones(2)] * (1 + RANK % 2)), *mismatch)
    inputs = [data(1100, r, (SIZE, 3)) for r in range(SIZE)]
    same("alltoall after the mismatches", kd.alltoall(inputs[RANK]),
         np.stack([inputs[r][RANK] for r in range(SIZE)]))


if __name__ == "__main__":
    run_checks([function for name, function in list(globals().items())
                if name.startswith("test_")],
               rank=RANK, passed="EXCHANGE {name} passed rank={rank}", agree=kd.allgather_object)
    print(f"EXCHANGE OK rank={RANK} size={SIZE}", flush=True)
