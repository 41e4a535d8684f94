"""Every rank's input, and the check of a result against a float64 (integers:
int64) reference every rank computes itself."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from keras_dist.bench.collectives.arguments import DTYPE_NAMES

#: Relative error allowed against the float64 reference, per rank, scaled by
#: the larger of sum(|x_i|) and |reference| (float16/bfloat16 are accumulated
#: in float32 and rounded once).
_TOLERANCE = {
    "float16": 2e-3,
    "bfloat16": 1.6e-2,
    "float32": 1e-6,
    "float64": 1e-13,
}
_CHECK_CHUNK_ELEMENTS = 1 << 20
_SEED = 20240


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a ``--dtype`` name (bfloat16 from ml_dtypes)."""
    if name == "bfloat16":
        from keras_dist import _vocab

        return _vocab.bfloat16_dtype()
    if name not in DTYPE_NAMES:
        raise ValueError(f"`dtype` must be one of {DTYPE_NAMES}. Received: {name!r}")
    return np.dtype(name)


def make_input(count: int, dtype_name: str, op: str, rank: int, nranks: int,
               salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s random input: the same on every rank that asks for it."""
    rng = np.random.default_rng([_SEED, salt, count, rank])
    dtype = numpy_dtype(dtype_name)
    if op == "product":
        if dtype.kind in "iu":
            return rng.integers(1, 4, count, dtype=np.int64).astype(dtype)
        return rng.uniform(0.5, 1.5, count).astype(dtype)
    if dtype.kind == "u":
        return rng.integers(1, max(2, 256 // nranks), count, dtype=np.int64).astype(dtype)
    if dtype.kind == "i":
        return rng.integers(-1000, 1000, count, dtype=np.int64).astype(dtype)
    if dtype in (np.float32, np.float64):
        return rng.standard_normal(count, dtype=dtype)
    return rng.standard_normal(count, dtype=np.float32).astype(dtype)


def _reduce_reference(op: str, chunks: list[np.ndarray], wide: type) -> np.ndarray:
    result = chunks[0].astype(wide)
    combine = {"sum": np.add, "min": np.minimum, "max": np.maximum,
               "product": np.multiply}[op]
    for chunk in chunks[1:]:
        combine(result, chunk.astype(wide), out=result)
    return result


def count_wrong_allreduce(result: np.ndarray, inputs: Sequence[np.ndarray], op: str) -> int:
    """Elements of ``result`` that differ from the reduction of ``inputs``.

    Integers must match the int64 reduction wrapped to their dtype; floats must
    lie within the dtype's tolerance (times the rank count) of the float64
    reduction, relative to max(sum(|x_i|), |reference|).
    """
    dtype = inputs[0].dtype
    result = np.asarray(result).reshape(-1)
    if result.dtype != dtype or result.size != inputs[0].size:
        return inputs[0].size
    wrong = 0
    integer = dtype.kind in "iu"
    tolerance = 0.0 if integer else _TOLERANCE[dtype.name] * len(inputs)
    for start in range(0, result.size, _CHECK_CHUNK_ELEMENTS):
        stop = start + _CHECK_CHUNK_ELEMENTS
        chunks = [a[start:stop] for a in inputs]
        if integer:
            expected = _reduce_reference(op, chunks, np.int64).astype(dtype)
            wrong += int(np.count_nonzero(result[start:stop] != expected))
            continue
        reference = _reduce_reference(op, chunks, np.float64)
        scale = np.abs(chunks[0].astype(np.float64))
        for chunk in chunks[1:]:
            scale += np.abs(chunk.astype(np.float64))
        np.maximum(scale, np.abs(reference), out=scale)
        error = np.abs(result[start:stop].astype(np.float64) - reference)
        wrong += int(np.count_nonzero(~(error <= tolerance * scale)))
    return wrong


def count_wrong_exact(result: np.ndarray, expected: np.ndarray) -> int:
    """Elements of ``result`` whose bytes differ from ``expected`` (broadcast, allgather)."""
    result = np.asarray(result).reshape(-1)
    expected = expected.reshape(-1)
    if result.dtype != expected.dtype or result.size != expected.size:
        return expected.size
    width = expected.dtype.itemsize
    view = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    return int(np.count_nonzero(result.view(view) != expected.view(view)))
