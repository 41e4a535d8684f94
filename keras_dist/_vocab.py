"""The vocabulary every layer shares: reduce ops, dtype and op codes, and how
a reduction is finished.

A leaf module: it imports nothing of the package, so the tensor layer (CPU and
GPU paths alike), the transports and the native bindings can all use it.

The integer codes are the ones the native extension (``native/src/reduce.h``)
uses; keep the two in step.
"""

from __future__ import annotations

import enum
import functools

import numpy as np

FLOAT16, BFLOAT16, FLOAT32, FLOAT64, INT32, INT64, UINT8, INT8, INT16, UINT16 = range(10)

SUM, MIN, MAX, PRODUCT = range(4)
OP_NAMES = {SUM: "sum", MIN: "min", MAX: "max", PRODUCT: "product"}


class ReduceOp(enum.Enum):
    """How ``allreduce`` combines the ranks' values."""

    AVERAGE = "average"
    SUM = "sum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    ADASUM = "adasum"


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
#: Adaptive summation (``keras_dist.tensor.adasum``): no transport op of its own.
Adasum = ReduceOp.ADASUM

#: The transport's op code for each public op (``Average`` is a sum, then a scale;
#: ``Adasum`` is computed from an allgather, so it has none).
TRANSPORT_OPS = {
    ReduceOp.AVERAGE: SUM,
    ReduceOp.SUM: SUM,
    ReduceOp.MIN: MIN,
    ReduceOp.MAX: MAX,
    ReduceOp.PRODUCT: PRODUCT,
}

_CODES: dict[np.dtype, int] = {
    np.dtype(np.float16): FLOAT16,
    np.dtype(np.float32): FLOAT32,
    np.dtype(np.float64): FLOAT64,
    np.dtype(np.int32): INT32,
    np.dtype(np.int64): INT64,
    np.dtype(np.uint8): UINT8,
    np.dtype(np.int8): INT8,
    np.dtype(np.int16): INT16,
    np.dtype(np.uint16): UINT16,
}
#: dtype name of each native code.
DTYPE_NAMES = {code: dtype.name for dtype, code in _CODES.items()}
DTYPE_NAMES[BFLOAT16] = "bfloat16"
SUPPORTED_DTYPE_NAMES = ", ".join(sorted(DTYPE_NAMES.values()))


@functools.cache
def bfloat16_dtype() -> np.dtype:
    """numpy's bfloat16 dtype, ml_dtypes' (a dependency of Keras; numpy has
    none of its own). Imported on first use: its import takes most of a
    second, which every ``kdrun`` and every rank would pay otherwise."""
    from ml_dtypes import bfloat16

    return np.dtype(bfloat16)


def _code(dtype: np.dtype) -> int | None:
    code = _CODES.get(dtype)
    # A bfloat16 array exists only once ml_dtypes is imported: look it up then.
    if code is None and dtype.name == "bfloat16" and dtype == bfloat16_dtype():
        code = _CODES[dtype] = BFLOAT16
    return code


def dtype_code(dtype) -> int:
    """Returns the native code of a numpy dtype, or raises ``TypeError``."""
    dtype = np.dtype(dtype)
    code = _code(dtype)
    if code is None:
        raise TypeError(
            f"keras_dist reduces only {SUPPORTED_DTYPE_NAMES}. "
            f"Received: dtype={dtype.name}"
        )
    return code


def is_supported(dtype) -> bool:
    return _code(np.dtype(dtype)) is not None


def is_half(dtype) -> bool:
    return dtype_code(dtype) in (FLOAT16, BFLOAT16)


@functools.lru_cache(maxsize=64)
def is_float(dtype) -> bool:
    """True for floating-point dtypes, half precision included."""
    dtype = np.dtype(dtype)
    return np.issubdtype(dtype, np.floating) or (is_supported(dtype) and is_half(dtype))


def finishing_scale(op: ReduceOp, dtype, size: int, postscale: float = 1.0) -> float | None:
    """How the transport's result becomes ``op``'s result, for CPU and GPU paths alike.

    Returns:
        The factor to multiply the reduced values by (1.0: leave them), or
        None for an integer ``Average``, which is a floor division by ``size``.
    """
    if op is ReduceOp.AVERAGE and not is_float(dtype):
        return None
    return postscale / size if op is ReduceOp.AVERAGE else postscale


def typed_factor(factor: float, dtype):
    """``factor`` as the scalar that scales ``dtype`` values the way Horovod does:
    half precision in float32 arithmetic, float32 in float32, float64 and
    integers in float64 (integers then truncated toward zero)."""
    if is_float(dtype) and np.dtype(dtype).itemsize == 2:
        return np.float32(factor)
    return factor


def scale_in_place(array, factor: float, xp=np) -> None:
    """``array *= factor`` in ``array``'s dtype (``xp``: numpy or cupy), as
    ``typed_factor`` says."""
    if factor == 1.0:
        return
    xp.multiply(array, typed_factor(factor, array.dtype), out=array, casting="unsafe")


def finish_reduction(flat, op: ReduceOp, size: int, postscale: float = 1.0, xp=np) -> None:
    """Applies ``finishing_scale`` to ``flat`` in place (``xp``: numpy or cupy); an
    integer ``Average`` rounds down, then takes any ``postscale``."""
    scale = finishing_scale(op, flat.dtype, size, postscale)
    if scale is None:
        flat //= size
        scale = postscale
    scale_in_place(flat, scale, xp)
