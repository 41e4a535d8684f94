"""The one dtype and reduction-op table shared by every layer.

The integer codes are the ones the native extension (``native/src/reduce.h``)
uses; keep the two in step.
"""

from __future__ import annotations

import numpy as np

try:  # ml_dtypes ships with TensorFlow and JAX; numpy has no bfloat16 of its own.
    from ml_dtypes import bfloat16 as _bfloat16
except ImportError:  # pragma: no cover - only without TF/JAX installed
    _bfloat16 = None

FLOAT16, BFLOAT16, FLOAT32, FLOAT64, INT32, INT64, UINT8 = range(7)

SUM, MIN, MAX, PRODUCT = range(4)
OP_NAMES = {SUM: "sum", MIN: "min", MAX: "max", PRODUCT: "product"}

_CODES: dict[np.dtype, int] = {
    np.dtype(np.float16): FLOAT16,
    np.dtype(np.float32): FLOAT32,
    np.dtype(np.float64): FLOAT64,
    np.dtype(np.int32): INT32,
    np.dtype(np.int64): INT64,
    np.dtype(np.uint8): UINT8,
}
if _bfloat16 is not None:
    _CODES[np.dtype(_bfloat16)] = BFLOAT16

SUPPORTED_DTYPE_NAMES = ", ".join(sorted(d.name for d in _CODES))


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
