"""Property-based tests of the public API, run identically on every rank.

Hypothesis is derandomised, so every rank draws the same examples in the same
order and calls the same collectives; each rank then derives its own data
from the drawn seed and its rank, and checks the result against a float64
numpy reference it computes for all ranks. Invalid input must raise
ValueError/TypeError on every rank alike: never a crash, a wrong answer or a hang.
"""

import os
import sys

import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import keras_dist as kd
from tests.multiprocess.workers._checks import run_checks

kd.init()
RANK, SIZE = kd.rank(), kd.size()
EXAMPLES = int(os.environ.get("KD_PROPERTY_EXAMPLES", "60"))
SETTINGS = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck))

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int32, np.int64, np.uint8]
OPS = [kd.Sum, kd.Average, kd.Min, kd.Max, kd.Product]
shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)


def make(seed, rank, shape, dtype):
    rng = np.random.default_rng([seed, rank])
    if np.dtype(dtype).kind in "iu":
        return rng.integers(1, 4, shape).astype(dtype)
    return rng.uniform(0.5, 1.5, shape).astype(dtype)


def reduce_reference(op, inputs):
    kind = inputs[0].dtype.kind
    wide = np.stack([a.astype(np.int64 if kind in "iu" else np.float64) for a in inputs])
    if op is kd.Average:
        return wide.sum(0) // SIZE if kind in "iu" else wide.mean(0)
    return {kd.Sum: wide.sum, kd.Min: wide.min, kd.Max: wide.max, kd.Product: wide.prod}[op](0)


@SETTINGS
@given(seed=st.integers(0, 2**31), shape=shapes, dtype=st.sampled_from(DTYPES),
       op=st.sampled_from(OPS))
def test_allreduce_matches_reference(seed, shape, dtype, op):
    inputs = [make(seed, r, shape, dtype) for r in range(SIZE)]
    result = kd.allreduce(inputs[RANK], op=op)
    assert result.shape == shape and result.dtype == np.dtype(dtype)
    expected = reduce_reference(op, inputs)
    if np.dtype(dtype).kind in "iu":
        assert np.array_equal(result, expected.astype(dtype))
    else:
        tolerance = {2: 4e-3, 4: 1e-5, 8: 1e-12}[np.dtype(dtype).itemsize]
        if dtype is ml_dtypes.bfloat16:
            tolerance = 3e-2
        np.testing.assert_allclose(result.astype(np.float64), expected,
                                   rtol=tolerance * SIZE * 2)


@SETTINGS
@given(seed=st.integers(0, 2**31), shape=shapes, dtype=st.sampled_from(DTYPES),
       root=st.integers(-2, 4))
def test_broadcast_valid_or_value_error(seed, shape, dtype, root):
    inputs = [make(seed, r, shape, dtype) for r in range(SIZE)]
    if not 0 <= root < SIZE:
        try:
            kd.broadcast(inputs[RANK], root_rank=root)
        except ValueError as error:
            assert "root_rank" in str(error)
            return
        raise AssertionError(f"root_rank={root} accepted at size {SIZE}")
    assert np.array_equal(kd.broadcast(inputs[RANK], root_rank=root).reshape(-1).view(np.uint8),
                          inputs[root].reshape(-1).view(np.uint8))


@SETTINGS
@given(seed=st.integers(0, 2**31), rows=st.lists(st.integers(0, 5), min_size=4, max_size=4),
       tail=shapes, dtype=st.sampled_from(DTYPES))
def test_allgather_ragged(seed, rows, tail, dtype):
    inputs = [make(seed, r, (rows[r % 4], *tail), dtype) for r in range(SIZE)]
    result = kd.allgather(inputs[RANK])
    assert np.array_equal(result.reshape(-1).view(np.uint8),
                          np.concatenate(inputs).reshape(-1).view(np.uint8))


payloads = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=20,
)


@SETTINGS
@given(payload=payloads, root=st.integers(0, 3))
def test_object_collectives(payload, root):
    root %= SIZE
    mine = [RANK, payload]
    assert kd.broadcast_object(mine, root_rank=root) == [root, payload]
    assert kd.allgather_object(mine) == [[r, payload] for r in range(SIZE)]


@SETTINGS
@given(dtype=st.sampled_from([np.complex64, np.bool_, np.uint32, np.uint64, np.float128]))
def test_unsupported_dtypes_are_type_errors(dtype):
    try:
        kd.allreduce(np.ones(3, dtype))
    except TypeError as error:
        assert np.dtype(dtype).name in str(error)
        return
    raise AssertionError(f"dtype {np.dtype(dtype).name} accepted")


if __name__ == "__main__":
    run_checks([function for name, function in list(globals().items())
                if name.startswith("test_")],
               rank=RANK, passed="rank {rank}: {name} passed", agree=kd.allgather_object)
    print(f"PROPERTIES OK rank={RANK} size={SIZE}", flush=True)
    sys.exit(0)
