"""keras_dist's TensorFlow ops (``KerasDistAllreduce``, ``KerasDistAllgather``) in one process.

A one-rank engine copies each input into its output, so every output must
equal its input bit for bit: this checks the op's hand-over (shapes, dtypes,
its reused output memory, outputs a program keeps), the bucket fallback on
an engine error and the op's status. The reduction itself across ranks is checked in
``tests/multiprocess`` (``test_tf_kernel.py``).
"""

import gc
import os
import secrets

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_dist import _native, _vocab  # noqa: E402
from keras_dist.tensor.tf import kernel as tf_kernel  # noqa: E402

SHAPES_DTYPES = [((3, 5), np.float32), ((7,), np.float64), ((), np.float32), ((0,), np.float32),
                 ((33,), np.float16), ((4, 4), np.int32), ((300, 70), np.float32)]


def _engine(slot_bytes: int):
    engine = _native.ShmEngine(f"/kd-test-{os.getpid()}-{secrets.token_hex(4)}", True, 0, 1,
                               slot_bytes, [os.getpid()])
    engine.attach()
    return engine


@pytest.fixture
def engine():
    engine = _engine(1 << 20)
    yield engine
    engine.leave()


@pytest.fixture
def small_engine():
    engine = _engine(1 << 16)
    yield engine
    engine.leave()


def _values(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(shape) * 100).astype(dtype) for shape, dtype in SHAPES_DTYPES]


def _buckets(arrays) -> list:
    """One bucket per dtype, as ``allreduce_plans.allreduce_plan`` groups them."""
    by_dtype: dict = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(a.dtype, []).append(i)
    return [(members, _vocab.dtype_code(np.dtype(d)), f"t {np.dtype(d).name}")
            for d, members in by_dtype.items()]


def _traced(engine, buckets, fallback=None, record=None):
    calls = []

    def default_fallback(index, srcs, dsts, error):
        calls.append((index, error))
        for s, d in zip(srcs, dsts):
            np.copyto(d, s)
        return None

    def step(*xs):
        return tf_kernel.allreduce(list(xs), engine, buckets, _vocab.SUM, False,
                                   fallback or default_fallback, record or (lambda *a: None))

    return tf.function(step), calls


def test_the_op_library_loads_and_registers_its_op():
    library = tf_kernel.library()
    assert library is not None, "keras_dist/_tf_ops.so did not load or did not register"
    assert hasattr(library, "keras_dist_allreduce")


def test_each_output_holds_its_input_with_its_shape_and_dtype(engine):
    arrays = _values(1)
    traced, calls = _traced(engine, _buckets(arrays))
    for seed in range(3):
        arrays = _values(seed)
        outputs = traced(*[tf.constant(a) for a in arrays])
        for array, output in zip(arrays, outputs):
            assert output.shape == array.shape and output.dtype == tf.as_dtype(array.dtype)
            assert np.array_equal(output.numpy(), array)
    assert calls == []  # every bucket fitted the engine's buffer
    ops = traced.get_concrete_function(*[tf.constant(a) for a in arrays]).graph.get_operations()
    assert [op.type for op in ops].count("KerasDistAllreduce") == 1
    assert not any(op.type.startswith("PyFunc") for op in ops)


def test_outputs_a_program_keeps_are_never_overwritten(engine):
    arrays = _values(0)
    traced, _ = _traced(engine, _buckets(arrays))
    kept = []
    for seed in range(10):  # more calls than the op keeps memory for
        values = _values(seed)
        kept.append((values, traced(*[tf.constant(v) for v in values])))
    for values, outputs in kept:
        for value, output in zip(values, outputs):
            assert np.array_equal(output.numpy(), value)
    del kept
    gc.collect()
    values = _values(99)
    for value, output in zip(values, traced(*[tf.constant(v) for v in values])):
        assert np.array_equal(output.numpy(), value)


def test_a_bucket_larger_than_the_engine_buffer_is_reduced_without_the_fallback(small_engine):
    engine = small_engine
    arrays = _values(2)
    assert any(a.nbytes > engine.buffer_bytes for a in arrays), (
        "the test needs a tensor larger than the engine's buffer")
    traced, calls = _traced(engine, _buckets(arrays))
    outputs = traced(*[tf.constant(a) for a in arrays])
    for array, output in zip(arrays, outputs):
        assert np.array_equal(output.numpy(), array)
    assert calls == []


def test_a_fallback_status_fails_the_step_with_its_code_and_message(engine):
    arrays = _values(3)

    def failing(index, srcs, dsts, error):
        return 9, "keras_dist CollectiveMismatchError: ranks disagree (test)"

    traced, _ = _traced(engine, _buckets(arrays), fallback=failing)
    engine.leave()  # the engine now raises on every bucket: each goes to the fallback
    with pytest.raises(tf.errors.FailedPreconditionError, match="ranks disagree \\(test\\)"):
        traced(*[tf.constant(a) for a in arrays])


def test_an_engine_error_reaches_the_fallback_as_the_python_error(engine):
    arrays = [np.arange(6, dtype=np.float32)]
    seen = []

    def fallback(index, srcs, dsts, error):
        seen.append(error)
        return tf_kernel.status_of(error, _native.CollectiveMismatchError)

    traced, _ = _traced(engine, _buckets(arrays), fallback=fallback)
    engine.leave()  # the engine now refuses every collective
    with pytest.raises(tf.errors.OpError, match="TransportError"):
        traced(tf.constant(arrays[0]))
    assert len(seen) == 1 and isinstance(seen[0], _native.TransportError)


def test_a_step_whose_plan_is_gone_fails_and_says_why(engine):
    arrays = [np.arange(4, dtype=np.float32)]
    plan = _native.TfPlan(engine, _buckets(arrays), _vocab.SUM, False, [16],
                          lambda *a: None, lambda *a: None)
    number = plan.id
    del plan
    gc.collect()

    @tf.function
    def step(x):
        return tf_kernel.library().keras_dist_allreduce(
            [x], plan=number, entry=_native.tf_entry_address())

    with pytest.raises(tf.errors.FailedPreconditionError, match="plan is gone"):
        step(tf.constant(arrays[0]))


def test_a_timeline_records_the_call_when_one_records(engine, tmp_path):
    from keras_dist.tensor import ops  # sets up the counters the entry adds to

    arrays = _values(4)
    spans = []
    traced, _ = _traced(engine, _buckets(arrays),
                        record=lambda start, end, wait: spans.append((start, end, wait)))
    before = ops.COUNTERS["allreduce"]
    traced(*[tf.constant(a) for a in arrays])
    assert spans == []  # no timeline
    assert ops.COUNTERS["allreduce"] - before == len(_buckets(arrays))
    _native.set_dispatch_recording(True)  # what the timeline hands over: recording
    try:
        traced(*[tf.constant(a) for a in arrays])
    finally:
        _native.set_dispatch_recording(False)
    assert len(spans) == 1
    start, end, wait = spans[0]
    assert 0 < start <= end and 0 <= wait <= end - start


def test_a_scaled_plan_rounds_each_scaling_to_the_dtype_and_keeps_its_inputs(engine):
    """prescale and postscale: each output is ``x * pre`` then ``* post``, each
    rounded to the dtype (float16 and bfloat16 in float32 arithmetic, float32
    in float32: numpy 2's ``x *= factor``), bit for bit; the inputs, read
    after the op, are untouched."""
    import ml_dtypes

    rng = np.random.default_rng(5)
    kinds = [((3, 5), np.float32), ((7,), np.float64), ((33,), np.float16),
             ((9, 2), ml_dtypes.bfloat16), ((300, 70), np.float32)]
    arrays = [(rng.standard_normal(shape) * 100).astype(dtype) for shape, dtype in kinds]
    pre, post = 0.3, 7.0

    @tf.function
    def step(*xs):
        outputs = tf_kernel.allreduce(list(xs), engine, _buckets(arrays), _vocab.SUM, False,
                                      lambda *a: None, lambda *a: None, pre, post)
        return outputs, xs

    def scaled(values, factor):  # spelled out: numpy 1's promotion would compute halves in half
        if values.dtype == np.float64:
            return values * factor
        return (values.astype(np.float32) * np.float32(factor)).astype(values.dtype)

    outputs, inputs = step(*[tf.constant(a) for a in arrays])
    for a, got, kept in zip(arrays, outputs, inputs):
        want = scaled(scaled(a, pre), post)
        assert got.numpy().dtype == a.dtype and got.numpy().tobytes() == want.tobytes(), a.dtype
        assert kept.numpy().tobytes() == a.tobytes(), a.dtype


def test_plan_arguments_are_checked(engine):
    int32 = _vocab.dtype_code(np.dtype(np.int32))
    with pytest.raises(ValueError, match="scaling needs floating-point tensors"):
        _native.TfPlan(engine, [([0], int32, "t")], _vocab.SUM, False, [16],
                       lambda *a: None, lambda *a: None, 2.0, 1.0)
    with pytest.raises(ValueError, match="past the plan's 1 tensors"):
        _native.TfPlan(engine, [([0, 1], _vocab.dtype_code(np.dtype(np.float32)), "t")],
                       _vocab.SUM, False, [16], lambda *a: None, lambda *a: None)
    with pytest.raises(TypeError, match="`engine` must be a ShmEngine"):
        _native.TfPlan(object(), [], _vocab.SUM, False, [], lambda *a: None, lambda *a: None)


# KerasDistAllgather: on a one-rank engine each output is its input (a
# scalar as a vector of one element).
GATHER_VALUES = [((5, 3), np.float32), ((), np.int64), ((0, 4), np.float16), ((9000,), np.uint8)]


def _gather_values(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(shape) * 100).astype(dtype) for shape, dtype in GATHER_VALUES]


def _traced_gather(engine, dtypes, fallback=None, record=None):
    def step(*xs):
        return tf_kernel.allgather(list(xs), engine, [f"g{i}" for i in range(len(xs))],
                                   [np.dtype(d) for d in dtypes],
                                   fallback or (lambda *a: (2, "unexpected fallback")),
                                   record or (lambda *a: None))

    return tf.function(step)


def test_the_allgather_op_gives_each_input_back_on_one_rank(engine):
    assert tf_kernel.gathers(), "the op library did not register KerasDistAllgather"
    traced = _traced_gather(engine, [d for _, d in GATHER_VALUES])
    for seed in range(3):
        arrays = _gather_values(seed)
        outputs = traced(*[tf.constant(a) for a in arrays])
        for array, output in zip(arrays, outputs):
            want = array.reshape(-1) if array.ndim == 0 else array
            assert output.shape == want.shape and output.dtype == tf.as_dtype(array.dtype)
            assert output.numpy().tobytes() == want.tobytes()
    ops = traced.get_concrete_function(*[tf.constant(a) for a in arrays]).graph.get_operations()
    assert [op.type for op in ops].count("KerasDistAllgather") == 1
    assert not any(op.type.startswith("PyFunc") for op in ops)


def test_an_allgather_engine_error_reaches_the_fallback_and_fails_the_step(engine):
    seen = []

    def fallback(index, headers, error):
        seen.append((index, headers, error))
        return tf_kernel.status_of(error, _native.CollectiveMismatchError)

    traced = _traced_gather(engine, [np.float32], fallback=fallback)
    engine.leave()  # the engine now refuses every collective
    with pytest.raises(tf.errors.OpError, match="TransportError"):
        traced(tf.constant(np.ones((2, 2), np.float32)))
    assert len(seen) == 1
    index, headers, error = seen[0]
    assert index == 0 and headers is None and isinstance(error, _native.TransportError)


def test_an_allgather_is_counted_and_recorded_with_its_bytes(engine):
    from keras_dist.tensor import ops  # sets up the counters the entry adds to

    spans = []
    traced = _traced_gather(engine, [d for _, d in GATHER_VALUES],
                            record=lambda *args: spans.append(args))
    arrays = _gather_values(5)
    before = ops.COUNTERS["allgather"]
    traced(*[tf.constant(a) for a in arrays])
    assert spans == []  # no timeline
    assert ops.COUNTERS["allgather"] - before == len(arrays)
    _native.set_dispatch_recording(True)  # what the timeline hands over: recording
    try:
        traced(*[tf.constant(a) for a in arrays])
    finally:
        _native.set_dispatch_recording(False)
    assert [(index, nbytes) for index, nbytes, *_ in spans] == [
        (i, a.nbytes) for i, a in enumerate(arrays)]
    for _, _, start, end, wait in spans:
        assert 0 < start <= end and 0 <= wait <= end - start


def test_an_allgather_whose_plan_is_gone_or_another_kind_fails_and_says_why(engine):
    reduce_plan = _native.TfPlan(engine, [], _vocab.SUM, False, [], lambda *a: None,
                                 lambda *a: None)
    gather_plan = _native.TfGatherPlan(engine, ["g"], [np.dtype(np.float32).num], [4],
                                       lambda *a: None, lambda *a: None)
    gone = gather_plan.id
    del gather_plan
    gc.collect()
    for number in (gone, reduce_plan.id):

        @tf.function
        def step(x, number=number):
            return tf_kernel.library().keras_dist_allgather(
                [x], plan=number, entry=_native.tf_allgather_entry_address())

        with pytest.raises(tf.errors.FailedPreconditionError, match="allgather plan is gone"):
            step(tf.constant(np.ones(3, np.float32)))


def test_gather_plan_arguments_are_checked(engine):
    with pytest.raises(ValueError, match="one name, type number and item size per tensor"):
        _native.TfGatherPlan(engine, ["a", "b"], [11], [4], lambda *a: None, lambda *a: None)
    with pytest.raises(TypeError, match="`engine` must be a ShmEngine"):
        _native.TfGatherPlan(object(), [], [], [], lambda *a: None, lambda *a: None)
