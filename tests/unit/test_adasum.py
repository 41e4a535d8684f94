"""The Adasum math (keras_dist.tensor.adasum) against a float64 reference
written here, and its argument checks; no ranks needed."""

import types

import numpy as np
import pytest

from keras_dist.tensor import adasum


def reference_pair(a, b):
    """Adasum of two vectors written as a sum minus half the dot product along
    each vector's direction (a zero vector contributes no correction)."""
    dot = sum(float(x) * float(y) for x, y in zip(a, b))
    out = a + b
    for v in (a, b):
        norm_sq = sum(float(x) ** 2 for x in v)
        if norm_sq > 0:
            out = out - (0.5 * dot / norm_sq) * v
    return out


def reference(vectors):
    """The halves of the ranks combined recursively: the same tree as
    recursive doubling ([0, n/2) with [n/2, n), and so on down)."""
    if len(vectors) == 1:
        return vectors[0]
    half = len(vectors) // 2
    return reference_pair(reference(vectors[:half]), reference(vectors[half:]))


def vectors(seed, count, size):
    rng = np.random.default_rng(seed)
    return [rng.uniform(-3.0, 3.0, size) for _ in range(count)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("count", [1, 2, 4, 8])
def test_tree_reduce_matches_reference(count):
    for seed in range(5):
        vs = vectors([seed, count], count, 7)
        got = adasum.tree_reduce(vs)
        np.testing.assert_allclose(got, reference(vs), rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(30)
def test_pair_properties():
    a, b = vectors(1, 2, 5)
    # Orthogonal vectors add; equal vectors give the vector itself (not twice).
    b_orth = b - (a @ b) / (a @ a) * a
    np.testing.assert_allclose(adasum.combine(a, b_orth), a + b_orth, atol=1e-12)
    np.testing.assert_allclose(adasum.combine(a, a.copy()), a, atol=1e-12)
    np.testing.assert_allclose(adasum.combine(a, b), adasum.combine(b, a), atol=1e-12)


@pytest.mark.timeout(30)
def test_zero_norm_vector_keeps_the_other():
    a, b, c = vectors(2, 3, 6)
    zero = np.zeros(6)
    np.testing.assert_array_equal(adasum.combine(zero, a), a)
    np.testing.assert_array_equal(adasum.combine(a, zero), a)
    vs = [a, zero, b, c]
    np.testing.assert_allclose(adasum.tree_reduce(vs), reference(vs), rtol=1e-12, atol=1e-12)


def fake_group(size, process_set_id=0):
    return types.SimpleNamespace(size=size, rank=0, ranks=tuple(range(size)),
                                 process_set_id=process_set_id)


def fake_gather(per_rank):
    def gather(array, name, group):
        assert array.shape[0] == 1
        return np.concatenate([p.reshape(array.shape) for p in per_rank])
    return gather


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_allreduce_arrays_scales_and_casts(dtype):
    size = 4
    inputs = [v.reshape(2, 3).astype(dtype) for v in vectors(3, size, 6)]
    got = adasum.allreduce_arrays([inputs[1]], None, 0.5, 3.0, "t", fake_group(size),
                                  gather=fake_gather(inputs))[0]
    want = 3.0 * reference([0.5 * x.astype(np.float64).ravel() for x in inputs])
    assert got.dtype == np.dtype(dtype) and got.shape == (2, 3)
    tol = {np.float16: 5e-3, np.float32: 1e-6, np.float64: 1e-12}[dtype]
    np.testing.assert_allclose(got.astype(np.float64), want.reshape(2, 3), rtol=tol, atol=tol)


@pytest.mark.timeout(30)
def test_check_inputs_errors():
    with pytest.raises(TypeError, match=r"floating-point dtypes only.*Received: dtype=int32"):
        adasum.check_inputs([np.dtype(np.int32)], fake_group(2), False)
    with pytest.raises(NotImplementedError, match=r"power-of-2.*Received: size=3"):
        adasum.check_inputs([np.dtype(np.float32)], fake_group(3), False)
    with pytest.raises(NotImplementedError, match="global process set only"):
        adasum.check_inputs([np.dtype(np.float32)], fake_group(2, process_set_id=1), False)
    with pytest.raises(NotImplementedError, match="cupy"):
        adasum.check_inputs([np.dtype(np.float32)], fake_group(2), True)
    with pytest.raises(NotImplementedError, match="power-of-2"):
        adasum.tree_reduce(vectors(4, 6, 3))
    for size in (1, 2, 4, 8):
        adasum.check_inputs([np.dtype(np.float16), np.dtype(np.float64)], fake_group(size), False)
