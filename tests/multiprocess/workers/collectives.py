"""Every collective on every rank, checked against numpy float64 references.

Each rank draws its data from a generator seeded by (case, rank), so every
rank can compute every other rank's contribution, and so the reference,
independently and in float64. Prints "COLLECTIVES OK rank=R size=N" at the end.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

import keras_dist as kd  # noqa: E402
from tests.multiprocess.workers._checks import run_checks  # noqa: E402

kd.init()
RANK, SIZE = kd.rank(), kd.size()
LARGE = int(os.environ.get("KD_TEST_LARGE", "3000001"))

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int32, np.int64, np.uint8]
OPS = [kd.Sum, kd.Average, kd.Min, kd.Max, kd.Product]
SIZES = [0, 1, 7, 1000, 65537]
# Relative error allowed against the float64 reference, scaled by sum(|x_i|).
TOLERANCE = {
    np.dtype(np.float16): 2e-3,
    np.dtype(ml_dtypes.bfloat16): 1.6e-2,
    np.dtype(np.float32): 1e-6,
    np.dtype(np.float64): 1e-13,
}


def contribution(case, rank, count, dtype, op):
    """Rank ``rank``'s random input for test case ``case``."""
    rng = np.random.default_rng([case, rank])
    dtype = np.dtype(dtype)
    if op is kd.Product:
        if dtype.kind in "iu":
            return rng.integers(1, 4, count).astype(dtype)
        return rng.uniform(0.5, 1.5, count).astype(dtype)
    if dtype == np.uint8:
        return rng.integers(0, 256 // max(SIZE, 1), count).astype(dtype)
    if dtype.kind == "i":
        return rng.integers(-1000, 1000, count).astype(dtype)
    return rng.standard_normal(count).astype(dtype)


def reference(op, inputs):
    """The float64 (or int64) reduction of ``inputs`` (one array per rank)."""
    dtype = inputs[0].dtype
    wide = np.stack([a.astype(np.int64 if dtype.kind in "iu" else np.float64) for a in inputs])
    if op is kd.Sum:
        return wide.sum(0)
    if op is kd.Average:
        return wide.sum(0) // SIZE if dtype.kind in "iu" else wide.mean(0)
    if op is kd.Min:
        return wide.min(0)
    if op is kd.Max:
        return wide.max(0)
    return wide.prod(0)


def check(label, result, ref, inputs):
    result = np.asarray(result)
    dtype = inputs[0].dtype
    assert result.dtype == dtype, f"{label}: dtype {result.dtype} != {dtype}"
    assert result.shape == ref.shape, f"{label}: shape {result.shape} != {ref.shape}"
    if dtype.kind in "iu":
        expected = ref.astype(dtype)  # wraps like the C kernels do
        assert np.array_equal(result, expected), f"{label}: integer result differs"
        return
    # sum(|x_i|) and the relative error, in place: the 32 MiB cases made
    # these arrays the worker's largest cost.
    scale = np.zeros(ref.shape, np.float64)
    for a in inputs:
        scale += np.abs(a.astype(np.float64))
    np.maximum(scale, np.abs(ref), out=scale)
    np.maximum(scale, 1e-300, out=scale)
    error = result.astype(np.float64)
    error -= ref
    np.abs(error, out=error)
    error /= scale
    worst = float(np.max(error)) if error.size else 0.0
    assert worst <= TOLERANCE[dtype] * SIZE, f"{label}: relative error {worst:.3g}"


def test_allreduce_every_op_dtype_size():
    case = 0
    for op in OPS:
        for dtype in DTYPES:
            for count in SIZES:
                case += 1
                inputs = [contribution(case, r, count, dtype, op) for r in range(SIZE)]
                mine = inputs[RANK].copy()
                result = kd.allreduce(mine, op=op)
                assert np.array_equal(mine.view(np.uint8), inputs[RANK].view(np.uint8)), \
                    "allreduce modified its input"
                check(f"allreduce {op} {np.dtype(dtype).name} n={count}", result,
                      reference(op, inputs), inputs)


def test_allreduce_large():
    for case, (dtype, op) in enumerate([(np.float32, kd.Sum), (np.float64, kd.Average),
                                         (np.int64, kd.Max), (np.float16, kd.Sum)], 1000):
        inputs = [contribution(case, r, LARGE, dtype, op) for r in range(SIZE)]
        check(f"large allreduce {np.dtype(dtype).name} {op}", kd.allreduce(inputs[RANK], op=op),
              reference(op, inputs), inputs)


def test_large_outputs_reused_only_when_released():
    # Results of 32 MiB and more come from recycled blocks: results still held
    # must survive later calls, and released ones are reused.
    count = (32 << 20) // 4 + 5
    held = []
    for case in range(3):
        inputs = [contribution(3000 + case, r, count, np.float32, kd.Sum) for r in range(SIZE)]
        held.append((kd.allreduce(inputs[RANK], op=kd.Sum), inputs))
    for i, (result, inputs) in enumerate(held):
        check(f"held 32 MiB result {i}", result, reference(kd.Sum, inputs), inputs)
    address = held[0][0].ctypes.data
    del held, result
    inputs = [contribution(3100, r, count, np.float32, kd.Min) for r in range(SIZE)]
    again = kd.allreduce(inputs[RANK], op=kd.Min)
    check("32 MiB result in a released block", again, reference(kd.Min, inputs), inputs)
    if SIZE > 1:
        assert again.ctypes.data == address, "a released 32 MiB result was not reused"


def test_scaling_and_scalars():
    inputs = [contribution(2000, r, 513, np.float32, kd.Sum) for r in range(SIZE)]
    result = kd.allreduce(inputs[RANK], op=kd.Average, prescale_factor=0.5, postscale_factor=3.0)
    check("pre/postscale", result, reference(kd.Average, inputs) * 1.5, inputs)
    total = kd.allreduce(float(RANK + 1), op=kd.Sum)
    assert isinstance(total, float) and total == SIZE * (SIZE + 1) / 2, total
    assert kd.allreduce(RANK, op=kd.Max) == SIZE - 1
    assert isinstance(kd.allreduce(np.float32(1.0)), np.float32)
    compressed = kd.allreduce(inputs[RANK], op=kd.Sum, compression=kd.Compression.fp16)
    assert compressed.dtype == np.float32
    halves = [i.astype(np.float16) for i in inputs]
    check("fp16 compression", compressed.astype(np.float16), reference(kd.Sum, halves), halves)


def test_grouped():
    specs = [(np.float32, (3, 5)), (np.int64, (7,)), (np.float16, (2, 2, 2)), (np.float32, ()),
             (np.float64, (0, 4)), (ml_dtypes.bfloat16, (9,)), (np.float32, (1000,))]
    inputs = [[contribution(3000 + i, r, int(np.prod(shape)), dtype, kd.Sum).reshape(shape)
               for r in range(SIZE)] for i, (dtype, shape) in enumerate(specs)]
    before = kd.ops.COUNTERS["allreduce"]
    results = kd.grouped_allreduce([per_rank[RANK] for per_rank in inputs], op=kd.Sum)
    buckets = kd.ops.COUNTERS["allreduce"] - before
    if SIZE > 1:  # one transport call per dtype: float32, int64, float16, bfloat16
        assert buckets == 4, f"grouped_allreduce made {buckets} transport calls, expected 4"
    for i, (result, per_rank) in enumerate(zip(results, inputs)):
        check(f"grouped[{i}]", result, reference(kd.Sum, per_rank), per_rank)


def test_allgather_broadcast_objects():
    rows = [np.full((r + 1, 3), r, np.int32) + contribution(4000, r, 3 * (r + 1), np.int32,
                                                            kd.Sum).reshape(r + 1, 3)
            for r in range(SIZE)]
    gathered = kd.allgather(rows[RANK])
    assert np.array_equal(gathered, np.concatenate(rows)), "ragged allgather differs"
    empty = kd.allgather(np.zeros((0, 2), np.float32))
    assert empty.shape == (0, 2)
    scalars = kd.allgather(np.float64(RANK) * 1.5)
    assert np.array_equal(scalars, np.arange(SIZE) * 1.5), scalars
    for root in range(SIZE):
        values = [contribution(5000 + root, r, 77, np.float64, kd.Sum) for r in range(SIZE)]
        mine = values[RANK].copy()
        got = kd.broadcast(mine, root_rank=root)
        assert np.array_equal(got, values[root]), f"broadcast from {root} differs"
        assert np.array_equal(mine, values[RANK]), "broadcast modified its input"
    assert kd.broadcast_object({"rank": RANK, "list": [RANK]}, root_rank=SIZE - 1) == \
        {"rank": SIZE - 1, "list": [SIZE - 1]}
    assert kd.allgather_object(("r", RANK)) == [("r", r) for r in range(SIZE)]
    kd.barrier()


def test_variables():
    variables = [keras.Variable(contribution(6000, RANK, 12, np.float32, kd.Sum).reshape(3, 4)),
                 keras.Variable(np.int64(RANK)), tf.Variable(np.full(5, RANK, np.float64))]
    kd.broadcast_variables(variables, root_rank=0)
    assert np.array_equal(variables[0].numpy(),
                          contribution(6000, 0, 12, np.float32, kd.Sum).reshape(3, 4))
    assert int(variables[1].numpy()) == 0 and not variables[2].numpy().any()
    inputs = [contribution(6100, r, 10, np.float32, kd.Sum) for r in range(SIZE)]
    check("allreduce of a keras Variable", kd.allreduce(keras.Variable(inputs[RANK]), op=kd.Sum),
          reference(kd.Sum, inputs), inputs)


def test_tensorflow_eager_and_graph():
    inputs = [contribution(7000, r, 300, np.float32, kd.Sum).reshape(10, 30) for r in range(SIZE)]
    eager = kd.allreduce(tf.constant(inputs[RANK]))
    assert isinstance(eager, tf.Tensor) and eager.dtype == tf.float32
    check("tf eager", eager.numpy(), reference(kd.Average, inputs), inputs)

    @tf.function
    def step(x, y):
        summed, maxed = kd.grouped_allreduce([x, y], op=kd.Sum)
        gathered = kd.allgather(x)
        root = kd.broadcast(x, root_rank=SIZE - 1)
        return summed, maxed, gathered, root, kd.allreduce(x * 2.0, op=kd.Max)

    ints = [contribution(7100, r, 6, np.int32, kd.Sum) for r in range(SIZE)]
    for _ in range(2):  # the traced function runs the collectives each call
        summed, summed_ints, gathered, root, maxed = step(tf.constant(inputs[RANK]),
                                                          tf.constant(ints[RANK]))
        check("tf.function sum", summed.numpy(), reference(kd.Sum, inputs), inputs)
        check("tf.function int sum", summed_ints.numpy(), reference(kd.Sum, ints), ints)
        assert np.array_equal(gathered.numpy(), np.concatenate(inputs))
        assert np.array_equal(root.numpy(), inputs[SIZE - 1])
        doubled = [2 * i for i in inputs]
        check("tf.function max", maxed.numpy(), reference(kd.Max, doubled), doubled)
    half = [contribution(7200, r, 33, ml_dtypes.bfloat16, kd.Sum) for r in range(SIZE)]
    result = tf.function(lambda t: kd.allreduce(t, op=kd.Sum))(tf.constant(half[RANK]))
    assert result.dtype == tf.bfloat16
    check("tf.function bfloat16", result.numpy(), reference(kd.Sum, half), half)


def test_bad_input():
    for bad_root in (-1, SIZE, 1.5):
        try:
            kd.broadcast(np.ones(2), root_rank=bad_root)
        except ValueError as error:
            assert "root_rank" in str(error) and "Received" in str(error), error
        else:
            raise AssertionError(f"root_rank={bad_root} was accepted")
    for bad in (np.ones(3, np.complex64), np.array([True, False])):
        try:
            kd.allreduce(bad)
        except TypeError as error:
            assert bad.dtype.name in str(error), error
        else:
            raise AssertionError(f"dtype {bad.dtype} was accepted")
    try:
        kd.allreduce(np.ones(2), op="sum")
    except ValueError as error:
        assert "op" in str(error)
    else:
        raise AssertionError("op='sum' was accepted")


def test_invalid_calls_raise_what_they_raise_at_one_rank():
    # The cases tests/unit/test_api_single_process.py checks at size 1: here every
    # rank must raise the same, before any data moves.
    import bad_inputs  # beside this file, which runs as a script

    failures = [failure for case in bad_inputs.CASES if case.every_rank
                for failure in [bad_inputs.raised(case, kd, SIZE)] if failure]
    assert not failures, "\n".join(failures)
    # Nothing of the failed calls is left in flight: the next collective lines up.
    inputs = [contribution(8000, r, 33, np.float64, kd.Sum) for r in range(SIZE)]
    check("allreduce after the invalid calls", kd.allreduce(inputs[RANK], op=kd.Sum),
          reference(kd.Sum, inputs), inputs)


# -- the one-call paths (a small C-contiguous numpy array straight to the shm engine) --

ONE_CALL_DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
                   np.uint8, np.uint16]
ONE_CALL_SHAPES = [(), (1,), (2, 3), (5,), (16384,), (16385,)]  # 64 KiB and past it in float32


def exact_reference(op, inputs):
    """The engine's result, computed independently in float64: a left-to-right fold
    in rank order, rounded after each step to the accumulation type (float32 for
    float16, else the dtype; float64 then rounding is exact for +, *, min, max
    of float32/float16 values), an average scaled by the dtype's rounded 1/size."""
    dtype = inputs[0].dtype
    if dtype.kind in "iu":  # wraps as the kernels do; an average floor-divides the wrapped sum
        if op is kd.Average:
            return reference(kd.Sum, inputs).astype(dtype) // dtype.type(SIZE)
        return reference(op, inputs).astype(dtype)
    accumulate = np.float32 if dtype == np.float16 else dtype
    combine = {kd.Sum: np.add, kd.Average: np.add, kd.Min: np.minimum, kd.Max: np.maximum,
               kd.Product: np.multiply}[op]
    acc = inputs[0].astype(np.float64)
    for a in inputs[1:]:
        acc = combine(acc, a.astype(np.float64)).astype(accumulate).astype(np.float64)
    if op is kd.Average:
        factor = np.float64(np.dtype(accumulate).type(1.0 / SIZE))
        acc = (acc.astype(dtype).astype(np.float64) * factor).astype(accumulate)
    return acc.astype(dtype)


def bits(array):
    """``array``'s bytes (any shape, 0-d included)."""
    return array.reshape(-1).view(np.uint8)


def strided(array):
    """``array``'s values in a non-contiguous array (the general path takes it)."""
    wide = np.zeros((*array.shape, 2), array.dtype)
    wide[..., 0] = array
    return wide[..., 0]


def test_one_call_allreduce_exact_on_every_rank():
    case = 9000
    for op in OPS:
        for dtype in ONE_CALL_DTYPES:
            for shape in ONE_CALL_SHAPES:
                case += 1
                count = int(np.prod(shape, dtype=np.int64))
                inputs = [contribution(case, r, count, dtype, op).reshape(shape)
                          for r in range(SIZE)]
                mine = inputs[RANK].copy()
                label = f"one-call allreduce {op} {np.dtype(dtype).name} {shape}"
                result = kd.allreduce(mine, op=op)
                assert np.array_equal(bits(mine), bits(inputs[RANK])), \
                    f"{label}: the input changed"
                assert (result is not mine or SIZE == 1) and result.shape == shape, label
                assert result.dtype == np.dtype(dtype), label
                expected = exact_reference(op, inputs)
                assert np.array_equal(bits(result), bits(expected)), \
                    f"{label}: {result} != {expected}"
                # Odd ranks take the general path (a strided input): the ranks still meet.
                general = kd.allreduce(strided(mine) if RANK % 2 else mine, op=op)
                assert np.array_equal(bits(general), bits(expected)), \
                    f"{label}, general path on odd ranks: {general} != {expected}"


def test_one_call_broadcast_and_allgather():
    case = 9500
    for dtype in [*ONE_CALL_DTYPES, np.bool_, np.complex64, np.uint64]:
        for shape in ONE_CALL_SHAPES:
            case += 1
            count = int(np.prod(shape, dtype=np.int64))
            inputs = [contribution(case, r, count, np.float64, kd.Sum).reshape(shape)
                      .astype(dtype) for r in range(SIZE)]
            label = f"{np.dtype(dtype).name} {shape}"
            root = SIZE - 1
            for mine in (inputs[RANK], strided(inputs[RANK]) if RANK % 2 else inputs[RANK]):
                result = kd.broadcast(mine, root_rank=root)
                assert result.dtype == mine.dtype, label
                assert np.array_equal(result, inputs[root]), f"broadcast {label}"
                gathered = kd.allgather(mine)
                expected = np.concatenate([a.reshape(-1) if a.ndim == 0 else a for a in inputs])
                assert gathered.dtype == mine.dtype, label
                assert np.array_equal(gathered, expected), f"allgather {label}"
    # Ranks with different first dimensions; odd ranks pass a TF tensor (the general path).
    rows = [contribution(9900, r, (r + 1) * 3, np.float32, kd.Sum).reshape(-1, 3)
            for r in range(SIZE)]
    value = tf.constant(rows[RANK]) if RANK % 2 else rows[RANK]
    gathered = np.asarray(kd.allgather(value))
    assert np.array_equal(gathered, np.concatenate(rows)), "allgather of uneven rows"
    # Rows either side of the 4 KiB that travel with the shapes: rank 0's data
    # fits there and the others' does not, so every rank takes the data step;
    # odd ranks take the general path.
    rows = [contribution(9905, r, (1 + 300 * r) * 4, np.float32, kd.Sum).reshape(-1, 4)
            for r in range(SIZE)]
    for mine in (rows[RANK], strided(rows[RANK]) if RANK % 2 else rows[RANK]):
        gathered = kd.allgather(mine)
        assert np.array_equal(gathered, np.concatenate(rows)), "allgather across 4 KiB"
    for dtype in (np.float16, np.int64, np.bool_):
        values = [contribution(9910, r, 6, np.float64, kd.Sum).reshape(2, 3).astype(dtype)
                  for r in range(SIZE)]
        value = tf.constant(values[RANK]) if RANK % 2 else values[RANK]
        result = np.asarray(kd.broadcast(value, root_rank=0))
        assert np.array_equal(result, values[0]), f"broadcast {np.dtype(dtype).name}, TF odd"


class _Subclass(np.ndarray):
    """An ndarray subclass: the one-call entries leave it to the general path."""


def test_one_call_counts_each_call_and_leaves_subclasses_to_the_general_path():
    from keras_dist.tensor.ops import COUNTERS

    inputs = [contribution(9930, r, 6, np.float32, kd.Sum).reshape(2, 3) for r in range(SIZE)]
    for mine in (inputs[RANK], inputs[RANK].view(_Subclass)):
        before = dict(COUNTERS)
        total = kd.allreduce(mine, op=kd.Sum)
        root = kd.broadcast(mine, root_rank=0)
        gathered = kd.allgather(mine)
        counted = {k: COUNTERS[k] - before[k] for k in ("allreduce", "broadcast", "allgather")}
        assert np.array_equal(np.asarray(total), exact_reference(kd.Sum, inputs)), total
        assert np.array_equal(np.asarray(root), inputs[0]), root
        assert np.array_equal(np.asarray(gathered), np.concatenate(inputs)), gathered
        if SIZE > 1:  # one transport call each, on either path
            assert counted == {"allreduce": 1, "broadcast": 1, "allgather": 1}, counted


def test_one_call_mismatch_raises_on_every_rank():
    if SIZE == 1:
        return
    x = contribution(9950, RANK, 12, np.float32, kd.Sum)
    calls = {
        "shape": lambda: kd.allreduce(x.reshape(3, 4) if RANK == 0 else x.reshape(4, 3)),
        "op": lambda: kd.allreduce(x, op=kd.Sum if RANK == 0 else kd.Average),
        "dtype": lambda: kd.allreduce(x if RANK == 0 else x.astype(np.float64)),
        "name": lambda: kd.allreduce(x, name="a" if RANK == 0 else "b"),
        "broadcast shape": lambda: kd.broadcast(x.reshape(3, 4) if RANK == 0
                                                else x.reshape(2, 6), root_rank=0),
        "allgather shape": lambda: kd.allgather(x.reshape(3, 4) if RANK == 0
                                                else x.reshape(2, 6)),
        "kind": lambda: kd.allreduce(x) if RANK == 0 else kd.broadcast(x, root_rank=0),
    }
    for what, call in calls.items():
        try:
            call()
        except kd.CollectiveMismatchError as error:
            if what == "allgather shape":
                assert "shape=(3, 4)" in str(error) and "shape=(2, 6)" in str(error), error
        else:
            raise AssertionError(f"no mismatch error for differing {what} on rank {RANK}")
        # The transport stays usable: the next call lines up on every rank.
        inputs = [contribution(9960, r, 5, np.float64, kd.Sum) for r in range(SIZE)]
        assert np.array_equal(kd.allreduce(inputs[RANK], op=kd.Sum),
                              exact_reference(kd.Sum, inputs)), f"allreduce after {what}"


if __name__ == "__main__":
    run_checks([function for name, function in list(globals().items())
                if name.startswith("test_")],
               rank=RANK, passed="rank {rank}: {name} passed", agree=kd.allgather_object)
    print(f"COLLECTIVES OK rank={RANK} size={SIZE} transport={kd._get().transport.name} "
          f"cross_size={kd.cross_size()}", flush=True)
