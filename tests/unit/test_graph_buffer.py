"""A traced TF step's host call hands its outputs back as one buffer (``one_buffer``)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_dist.errors import CollectiveMismatchError  # noqa: E402
from keras_dist.tensor import conversions, fusion  # noqa: E402
from keras_dist.tensor.collective import Collective  # noqa: E402
from keras_dist.tensor.tf import graph_buffer  # noqa: E402

# (shape, dtype, leaves the op in the buffer): up to 64 KiB, aligned or not,
# of a numeric dtype; larger ones and bools travel alone.
SPECS = [((64, 64), np.float32, True), ((129, 257), np.float32, False),
         ((7,), np.float32, True), ((33,), np.float16, True), ((5, 3), np.float64, True),
         ((10,), np.int32, True), ((0,), np.float32, True), ((), np.float32, True),
         ((4, 4), np.bool_, False), ((3,), np.uint8, True), ((128, 128), np.float32, True),
         ((128, 129), np.float32, False), ((300, 70), np.float64, False)]


def _inputs():
    rng = np.random.default_rng(5)
    return [(rng.standard_normal(shape) * 10).astype(dtype) for shape, dtype, _ in SPECS]


def _doubled_views(arrays):
    out = fusion.aligned_like(arrays)
    for view, array in zip(out, arrays):
        np.copyto(view, array if array.dtype == np.bool_ else array * 2)
    return out


def _doubled_arrays(arrays):
    return [a.copy() if a.dtype == np.bool_ else a * 2 for a in arrays]


def _host_call_outputs(traced, values) -> int:
    graph = traced.get_concrete_function(*values).graph
    calls = [op for op in graph.get_operations() if op.type.startswith("PyFunc")]
    assert len(calls) == 1, [op.type for op in calls]
    return len(calls[0].outputs)


@pytest.mark.parametrize("numpy_fn", [_doubled_views, _doubled_arrays],
                         ids=["aligned views", "other arrays (copied in)"])
def test_traced_outputs_leave_in_one_buffer_and_keep_their_values(numpy_fn):
    arrays = _inputs()
    values = [tf.constant(a) for a in arrays]
    traced = tf.function(lambda *xs: conversions.run(
        list(xs), Collective(numpy_fn, "t", one_buffer=True)))
    for _ in range(2):
        got = traced(*values)
        for (shape, dtype, _), array, result in zip(SPECS, arrays, got):
            assert result.shape == shape and result.dtype == tf.as_dtype(dtype)
            assert np.array_equal(result.numpy(), _doubled_arrays([array])[0])
    alone = sum(not inside for _, _, inside in SPECS)
    kinds = len({np.dtype(dtype) for _, dtype, inside in SPECS if inside})
    # The buffer once per dtype in it, the others, the status.
    assert _host_call_outputs(traced, values) == kinds + alone + 1
    plain = tf.function(lambda *xs: conversions.run(
        list(xs), Collective(numpy_fn, "t")))
    assert _host_call_outputs(plain, values) == len(SPECS) + 1


def test_layout_follows_aligned_like_and_needs_static_shapes():
    shapes = [tf.TensorShape(s) for s, _, _ in SPECS]
    dtypes = [tf.as_dtype(d) for _, d, _ in SPECS]
    offsets, total, nbytes, inside, kinds = graph_buffer.buffer_layout(dtypes, shapes)
    arrays = _inputs()
    views = fusion.aligned_like(arrays)
    start = views.region.ctypes.data
    assert views.region.nbytes == total
    assert nbytes == [a.nbytes for a in arrays]
    for view, offset in zip(views, offsets):
        if view.size:
            assert view.ctypes.data - start == offset
    assert inside == [flag for _, _, flag in SPECS]
    assert kinds == list(dict.fromkeys(d for d, flag in zip(dtypes, inside) if flag))
    assert graph_buffer.buffer_layout(dtypes[:2], [tf.TensorShape([None, 3])] * 2) is None
    assert graph_buffer.buffer_layout([tf.float32], [tf.TensorShape([4])]) is None


def test_a_mismatch_fails_the_traced_step_as_a_failed_precondition():
    def mismatched(arrays):
        raise CollectiveMismatchError("ranks disagree: shape (2,) vs (3,)")

    values = [tf.constant(np.ones(4, np.float32)), tf.constant(np.ones(3, np.float32))]
    traced = tf.function(lambda *xs: conversions.run(
        list(xs), Collective(mismatched, "t", one_buffer=True)))
    with pytest.raises(tf.errors.FailedPreconditionError, match="ranks disagree"):
        traced(*values)
