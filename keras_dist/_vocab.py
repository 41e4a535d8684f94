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

try:  # ml_dtypes ships with TensorFlow and JAX; numpy has no bfloat16 of its own.
    from ml_dtypes import bfloat16 as _bfloat16
except ImportError:  # pragma: no cover - only without TF/JAX installed
    _bfloat16 = None

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
if _bfloat16 is not None:
    _CODES[np.dtype(_bfloat16)] = BFLOAT16

SUPPORTED_DTYPE_NAMES = ", ".join(sorted(d.name for d in _CODES))
#: dtype name of each native code.
DTYPE_NAMES = {code: dtype.name for dtype, code in _CODES.items()}


def dtype_code(dtype) -> int:
    """Returns the native code of a numpy dtype, or raises ``TypeError``."""
    dtype = np.dtype(dtype)
    try:
        return _CODES[dtype]
    except KeyError:
        raise TypeError(
            f"keras_dist reduces only {SUPPORTED_DTYPE_NAMES}. "
            f"Received: dtype={dtype.name}"
        ) from None


def is_supported(dtype) -> bool:
    return np.dtype(dtype) in _CODES


def is_half(dtype) -> bool:
    return dtype_code(dtype) in (FLOAT16, BFLOAT16)


@functools.lru_cache(maxsize=64)
def is_float(dtype) -> bool:
    """True for floating-point dtypes, half precision included."""
    dtype = np.dtype(dtype)
    return np.issubdtype(dtype, np.floating) or (dtype in _CODES and is_half(dtype))


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
