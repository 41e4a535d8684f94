"""The native reduction kernels against numpy references, on both kernel families."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keras_dist import _native
from keras_dist import _vocab as _dtypes

DTYPES = {
    _dtypes.FLOAT16: np.dtype(np.float16),
    _dtypes.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    _dtypes.FLOAT32: np.dtype(np.float32),
    _dtypes.FLOAT64: np.dtype(np.float64),
    _dtypes.INT32: np.dtype(np.int32),
    _dtypes.INT64: np.dtype(np.int64),
    _dtypes.UINT8: np.dtype(np.uint8),
    _dtypes.INT8: np.dtype(np.int8),
    _dtypes.INT16: np.dtype(np.int16),
    _dtypes.UINT16: np.dtype(np.uint16),
}
OPS = {
    _dtypes.SUM: np.add,
    _dtypes.MIN: np.minimum,
    _dtypes.MAX: np.maximum,
    _dtypes.PRODUCT: np.multiply,
}
SIZES = [0, 1, 7, 513, 1000003]


@pytest.fixture(params=["native", "baseline"], autouse=True)
def kernel_family(request):
    """Runs every test with the best kernels and again with the baseline ones."""
    _native._force_baseline(request.param == "baseline")
    yield request.param
    _native._force_baseline(False)


def random_array(rng, dtype, size, op):
    """Random values, never zero; products stay in range for the float types."""
    if dtype.kind == "f" or dtype == DTYPES[_dtypes.BFLOAT16]:
        scale = 2.0 if op == _dtypes.PRODUCT else 100.0
        mag = rng.uniform(0.5, scale, size)
        values = np.where(rng.random(size) < 0.5, -mag, mag)
        return values.astype(dtype)
    info = np.iinfo(dtype)
    values = rng.integers(info.min, info.max, size, dtype=dtype, endpoint=True)
    values[values == 0] = 1
    return values


def reference(sources, dtype, op):
    """Left-to-right combination; half types in float32, rounded once."""
    half = dtype.itemsize == 2 and dtype.kind not in "iu"
    acc_dtype = np.float32 if half else dtype
    acc = sources[0].astype(acc_dtype)
    with np.errstate(over="ignore"):
        for src in sources[1:]:
            acc = OPS[op](acc, src.astype(acc_dtype))
        return acc.astype(dtype)


def same_bits(actual, expected):
    return np.array_equal(actual.view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("code", list(DTYPES))
def test_reduce_inplace_matches_numpy(code, op, size):
    dtype = DTYPES[code]
    rng = np.random.default_rng(size * 31 + code * 7 + op)
    dst = random_array(rng, dtype, size, op)
    src = random_array(rng, dtype, size, op)
    expected = reference([dst, src], dtype, op)
    _native.reduce_inplace(dst.view(np.uint8), src.view(np.uint8), code, op)
    assert same_bits(dst, expected)
    if dtype.kind == "f" and op == _dtypes.SUM and size:
        exact = dst.astype(np.float64)  # also close to the float64 answer
        rtol = 1e-2 if dtype.itemsize == 2 else 1e-6
        assert np.allclose(exact, expected.astype(np.float64), rtol=rtol)


@pytest.mark.parametrize("nsrcs", [1, 2, 3, 5])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("code", list(DTYPES))
def test_reduce_many_rounds_once(code, op, nsrcs):
    dtype = DTYPES[code]
    rng = np.random.default_rng(nsrcs * 100 + code * 10 + op)
    sources = [random_array(rng, dtype, 4099, op) for _ in range(nsrcs)]
    dst = np.empty_like(sources[0])
    _native.reduce_many(dst.view(np.uint8), [s.view(np.uint8) for s in sources], code, op)
    assert same_bits(dst, reference(sources, dtype, op))
    # The destination may be one of the sources.
    _native.reduce_many(sources[-1].view(np.uint8), [s.view(np.uint8) for s in sources], code, op)
    assert same_bits(sources[-1], dst)


FINISH_CASES = [(op, nsrcs, ranks) for op in OPS for nsrcs in (1, 2, 3)
                for ranks in ((0, 2, 3) if op == _dtypes.SUM else (0,))]


@pytest.mark.parametrize(("op", "nsrcs", "average_ranks"), FINISH_CASES)
@pytest.mark.parametrize("code", list(DTYPES))
def test_reduce_finish_writes_the_finished_reduction_into_both_buffers(code, op, nsrcs,
                                                                        average_ranks):
    dtype = DTYPES[code]
    rng = np.random.default_rng(code * 1000 + op * 100 + nsrcs * 10 + average_ranks)
    sources = [random_array(rng, dtype, 4099, op) for _ in range(nsrcs)]
    expected = reference(sources, dtype, op)
    if average_ranks:
        _dtypes.finish_reduction(expected, _dtypes.ReduceOp.AVERAGE, average_ranks)
    u8 = [s.view(np.uint8) for s in sources]
    dst, copy = np.full_like(expected, 3), np.full_like(expected, 5)
    _native._reduce_finish(dst.view(np.uint8), copy.view(np.uint8), u8, code, op, average_ranks)
    assert same_bits(dst, expected) and same_bits(copy, expected)
    # Without a copy, only the destination is written.
    dst[:] = 3
    _native._reduce_finish(dst.view(np.uint8), None, u8, code, op, average_ranks)
    assert same_bits(dst, expected)
    # Buffers off their element alignment take the three-step path, to the same bits.
    raw = np.zeros(2 * expected.nbytes + 2, np.uint8)
    odd_dst, odd_copy = raw[1:1 + expected.nbytes], raw[expected.nbytes + 2:]
    _native._reduce_finish(odd_dst, odd_copy, u8, code, op, average_ranks)
    assert np.array_equal(odd_dst, expected.view(np.uint8))
    assert np.array_equal(odd_copy, expected.view(np.uint8))
    # The copy may be one of the sources (as an in-place allreduce's destination is).
    _native._reduce_finish(dst.view(np.uint8), u8[-1], u8, code, op, average_ranks)
    assert same_bits(dst, expected) and same_bits(sources[-1], expected)


@pytest.mark.parametrize("code", [_dtypes.FLOAT16, _dtypes.BFLOAT16])
def test_the_half_types_average_every_bit_pattern_as_the_scalar_kernels_do(code):
    # NaNs with payloads, infinities, subnormals, ties: the vector average
    # (F16C for float16, AVX2 integer rounding for bfloat16) writes the bits
    # the scalar conversions write.
    every = np.arange(1 << 16, dtype=np.uint16).view(DTYPES[code])
    for ranks in (2, 3):
        results = []
        for baseline in (False, True):
            _native._force_baseline(baseline)
            dst = np.empty_like(every)
            _native._reduce_finish(dst.view(np.uint8), None, [every.view(np.uint8)], code,
                                   _dtypes.SUM, ranks)
            results.append(dst.view(np.uint16))
        assert np.array_equal(results[0], results[1]), np.nonzero(results[0] != results[1])


def test_reduce_finish_rejects_a_copy_of_another_size_and_negative_ranks():
    a = np.ones(8, np.float32)
    with pytest.raises(ValueError, match="`copy` must have as many bytes as `dst`"):
        _native._reduce_finish(a.view(np.uint8), np.ones(4, np.float32).view(np.uint8),
                               [a.view(np.uint8)], _dtypes.FLOAT32, _dtypes.SUM, 0)
    with pytest.raises(ValueError, match="`average_ranks` must be 0"):
        _native._reduce_finish(a.view(np.uint8), None, [a.view(np.uint8)], _dtypes.FLOAT32,
                               _dtypes.SUM, -1)


@pytest.mark.parametrize("code", [_dtypes.FLOAT16, _dtypes.BFLOAT16])
def test_half_conversions_are_exact_for_every_bit_pattern(code):
    dtype = DTYPES[code]
    everything = np.arange(1 << 16, dtype=np.uint16).view(dtype)
    finite = everything[np.isfinite(everything.astype(np.float32))]
    # One source: load to float32 and store back must be the identity.
    out = np.empty_like(finite)
    _native.reduce_many(out.view(np.uint8), [finite.view(np.uint8)], code, _dtypes.SUM)
    assert same_bits(out, finite)
    # Sums of every value with a few others: float32 sum rounded once (ties included).
    for other in (1.0, -3.5, 6.103515625e-05, 5.960464477539063e-08, 65504.0, 0.0999):
        src = np.full_like(finite, other)
        dst = finite.copy()
        _native.reduce_inplace(dst.view(np.uint8), src.view(np.uint8), code, _dtypes.SUM)
        assert same_bits(dst, reference([finite, src], dtype, _dtypes.SUM))


@pytest.mark.parametrize(
    "code", [_dtypes.FLOAT16, _dtypes.BFLOAT16, _dtypes.FLOAT32, _dtypes.FLOAT64]
)
def test_nan_and_inf_propagate_like_numpy(code):
    dtype = DTYPES[code]
    dst = np.array([np.nan, 1.0, np.inf, -np.inf, 2.0] * 5, dtype)
    src = np.array([1.0, np.nan, 1.0, 5.0, -np.inf] * 5, dtype)
    for op, func in OPS.items():
        got = dst.copy()
        _native.reduce_inplace(got.view(np.uint8), src.view(np.uint8), code, op)
        with np.errstate(invalid="ignore"):
            want = func(dst.astype(np.float64), src.astype(np.float64))
        np.testing.assert_array_equal(got.astype(np.float64), want)


def test_unaligned_buffers():
    rng = np.random.default_rng(5)
    for code, dtype in DTYPES.items():
        a = random_array(rng, dtype, 1001, _dtypes.SUM)
        b = random_array(rng, dtype, 1001, _dtypes.SUM)
        raw_a = np.empty(a.nbytes + 1, np.uint8)[1:]
        raw_b = np.empty(b.nbytes + 3, np.uint8)[3:]
        raw_a[:] = a.view(np.uint8)
        raw_b[:] = b.view(np.uint8)
        _native.reduce_inplace(raw_a, raw_b, code, _dtypes.SUM)
        assert same_bits(raw_a.copy().view(dtype), reference([a, b], dtype, _dtypes.SUM))


def test_bad_inputs_raise_clear_errors():
    f32 = np.ones(8, np.float32)
    u8 = f32.view(np.uint8)
    with pytest.raises(TypeError, match="dtype uint8"):
        _native.reduce_inplace(f32, f32, _dtypes.FLOAT32, _dtypes.SUM)
    with pytest.raises(ValueError, match="1-D"):
        _native.reduce_inplace(u8.reshape(4, 8), u8.reshape(4, 8), _dtypes.FLOAT32, _dtypes.SUM)
    with pytest.raises(ValueError, match="C-contiguous"):
        _native.reduce_inplace(np.ones(64, np.uint8)[::2], u8, _dtypes.FLOAT32, _dtypes.SUM)
    with pytest.raises(ValueError, match="as many bytes"):
        _native.reduce_inplace(u8, u8[:16], _dtypes.FLOAT32, _dtypes.SUM)
    with pytest.raises(ValueError, match="whole float32 elements"):
        _native.reduce_inplace(u8[:6], u8[:6], _dtypes.FLOAT32, _dtypes.SUM)
    with pytest.raises(ValueError, match="dtype code"):
        _native.reduce_inplace(u8, u8, max(DTYPES) + 1, _dtypes.SUM)
    with pytest.raises(ValueError, match="op code"):
        _native.reduce_inplace(u8, u8, _dtypes.FLOAT32, 4)
    readonly = u8.copy()
    readonly.flags.writeable = False
    with pytest.raises(TypeError, match="writable"):
        _native.reduce_inplace(readonly, u8, _dtypes.FLOAT32, _dtypes.SUM)
    with pytest.raises(TypeError, match="uint8"):
        _native.reduce_inplace([1, 2, 3, 4], u8[:4], _dtypes.UINT8, _dtypes.SUM)
    with pytest.raises(ValueError, match=r"srcs\[1\]"):
        _native.reduce_many(u8, [u8, u8[:4]], _dtypes.FLOAT32, _dtypes.SUM)


def test_simd_level_names_a_family():
    assert _native.simd_level() in ("avx2", "baseline")


@settings(max_examples=60, deadline=None)
@given(
    code=st.sampled_from(list(DTYPES)),
    op=st.sampled_from(list(OPS)),
    size=st.integers(0, 3000),
    nsrcs=st.integers(1, 6),
    offset=st.integers(0, 7),
    seed=st.integers(0, 2**32 - 1),
)
def test_reduce_many_property(code, op, size, nsrcs, offset, seed):
    """Any dtype, op, length, source count and byte alignment: the sequential reference."""
    dtype = DTYPES[code]
    rng = np.random.default_rng(seed)
    sources = [random_array(rng, dtype, size, op) for _ in range(nsrcs)]
    raw = np.zeros(size * dtype.itemsize + offset, np.uint8)
    dst = raw[offset:]
    _native.reduce_many(dst, [s.view(np.uint8) for s in sources], code, op)
    assert np.array_equal(dst, reference(sources, dtype, op).view(np.uint8))


# -- one-call collectives of numpy arrays, on an engine of one rank ----------
# (the engine: ``one_rank_engine`` in conftest.py)


@pytest.mark.parametrize("extra_ranks", [0, 1])
def test_waits_poll_longer_when_every_local_rank_has_a_cpu(extra_ranks):
    import os
    import secrets

    cpus = len(os.sched_getaffinity(0))
    try:  # a container's cgroup v2 CPU quota caps it, as the engine reads it
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max" and int(quota) > 0 and int(period) > 0:
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    size = cpus + extra_ranks  # as many local ranks as CPUs, then one more
    engine = _native.ShmEngine(f"/kd-test-{os.getpid()}-{secrets.token_hex(4)}", True, 0,
                               size, 1 << 16, [os.getpid()] * size)
    try:
        timings = _native.WAIT_TIMINGS
        expected = timings["yield_seconds"] if extra_ranks else timings["own_core_yield_seconds"]
        assert engine.yield_seconds == expected
        assert timings["own_core_yield_seconds"] > timings["yield_seconds"]
        engine.yield_seconds = 0.5
        assert engine.yield_seconds == 0.5
        for bad in (-1e-6, 1.5, float("nan")):
            with pytest.raises(ValueError, match=r"`yield_seconds` must be in \[0, 1\]"):
                engine.yield_seconds = bad
        assert engine.yield_seconds == 0.5
    finally:
        engine.unlink()


ARRAY_CALL_DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32,
                     np.int64, np.longlong, np.uint8, np.uint16]


@pytest.mark.parametrize("dtype", ARRAY_CALL_DTYPES)
@pytest.mark.parametrize("shape", [(), (1,), (3, 4), (2, 0)])
def test_array_calls_return_a_new_array(one_rank_engine, dtype, shape):
    x = np.random.default_rng(7).integers(-50, 50, shape).astype(dtype)
    before = x.copy()
    for op in range(5):  # Average, Sum, Min, Max, Product: the identity on one rank
        out = one_rank_engine.allreduce_array(x, op, "label")
        assert type(out) is np.ndarray and out is not x and not np.shares_memory(out, x)
        assert out.dtype == x.dtype and out.shape == x.shape and np.array_equal(out, x)
    out = one_rank_engine.broadcast_array(x, 0, None)
    assert out is not x and out.dtype == x.dtype and np.array_equal(out, x)
    gathered = one_rank_engine.allgather_array(x, None)
    assert gathered.dtype == x.dtype and gathered.shape == (x.shape or (1,))
    assert np.array_equal(gathered.reshape(-1), x.reshape(-1))
    assert np.array_equal(x, before), "the input changed"


def test_array_calls_decline_what_the_general_path_must_serve(one_rank_engine):
    engine = one_rank_engine
    f32 = np.arange(8, dtype=np.float32)
    declined = {
        "strided": lambda: engine.allreduce_array(f32[::2], 1, None),
        "complex allreduce": lambda: engine.allreduce_array(f32.view(np.complex64), 1, None),
        "bool allreduce": lambda: engine.allreduce_array(np.ones(2, bool), 1, None),
        "bfloat16": lambda: engine.allreduce_array(f32.astype(ml_dtypes.bfloat16), 1, None),
        "big-endian": lambda: engine.allreduce_array(f32.astype(">f4"), 1, None),
        "over 64 KiB": lambda: engine.allreduce_array(np.ones(16385, np.float32), 1, None),
        "op -1": lambda: engine.allreduce_array(f32, -1, None),
        "op 5": lambda: engine.allreduce_array(f32, 5, None),
        "name not a str": lambda: engine.allreduce_array(f32, 1, 3),
        "a list": lambda: engine.allreduce_array([1.0, 2.0], 1, None),
        "root 1 of 1": lambda: engine.broadcast_array(f32, 1, None),
        "root -1": lambda: engine.broadcast_array(f32, -1, None),
        "root True": lambda: engine.broadcast_array(f32, True, None),
        "root 0.0": lambda: engine.broadcast_array(f32, 0.0, None),
        "root numpy int": lambda: engine.broadcast_array(f32, np.int64(0), None),
        "object broadcast": lambda: engine.broadcast_array(np.array([None]), 0, None),
        "float128 allgather": lambda: engine.allgather_array(np.ones(2, np.longdouble), None),
        "9 dimensions": lambda: engine.allgather_array(np.ones((1,) * 9), None),
    }
    for what, call in declined.items():
        assert call() is None, what
    # Still in step afterwards.
    assert np.array_equal(engine.allreduce_array(f32, 1, None), f32)


def test_fill_views_checks_its_arguments():
    from keras_dist import _native

    raw = np.zeros(256, np.uint8)
    views: list = []
    start = _native.fill_views(views, raw, 64, [0, 64], [np.ones(3, np.float32), np.int64(5)])
    assert start == -raw.ctypes.data % 64
    assert [(v.shape, v.dtype) for v in views] == [((3,), np.float32), ((), np.int64)]
    assert views[1].ctypes.data == raw.ctypes.data + start + 64
    views[0][:] = 2.0  # writes raw's bytes
    assert np.array_equal(raw[start:start + 12].view(np.float32), [2.0, 2.0, 2.0])
    bad = {
        "not an array": lambda: _native.fill_views([], b"x" * 256, 64, [0], [raw]),
        "read-only": lambda: _native.fill_views([], np.frombuffer(b"x" * 256, np.uint8), 64,
                                                [0], [raw[:4]]),
        "align 3": lambda: _native.fill_views([], raw, 3, [0], [raw[:4]]),
        "past the end": lambda: _native.fill_views([], raw, 64, [192], [np.ones(64)]),
        "negative offset": lambda: _native.fill_views([], raw, 64, [-8], [raw[:4]]),
        "offsets and templates differ": lambda: _native.fill_views([], raw, 64, [0, 8], [raw]),
        "not an array template": lambda: _native.fill_views([], raw, 64, [0], [[1.0]]),
    }
    for what, call in bad.items():
        with pytest.raises((ValueError, TypeError)) as info:
            call()
        assert "fill_views" in str(info.value) or "incompatible" in str(info.value), what
