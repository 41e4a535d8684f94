"""Gradient compression: ``Compression.none`` and ``Compression.fp16``."""

from __future__ import annotations

import numpy as np

from keras_dist.tensor import kinds


class _NoCompression:
    """Sends values as they are."""

    @staticmethod
    def compress(value):
        return value, None

    @staticmethod
    def decompress(value, ctx):
        return value


class _FP16Compression:
    """Sends floating-point values as float16 and restores their dtype after."""

    @staticmethod
    def compress(value):
        dtype = kinds.dtype_of(value)
        if not np.issubdtype(dtype, np.floating) or dtype == np.float16:
            return value, None
        return kinds.cast(value, np.float16), dtype

    @staticmethod
    def decompress(value, ctx):
        return value if ctx is None else kinds.cast(value, ctx)


class Compression:
    """Gradient compression choices: ``Compression.none`` and ``Compression.fp16``."""

    none = _NoCompression
    fp16 = _FP16Compression
