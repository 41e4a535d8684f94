"""Fusion: many tensors of one dtype travel as one flat buffer.

``plan_buckets`` groups arrays by dtype, in first-appearance order, and splits
each group at the fusion threshold. Every rank builds the same plan from the
same list, so buckets line up across ranks without any negotiation.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from keras_dist import _native
from keras_dist.tensor import outputs


def plan_buckets(arrays: Sequence[np.ndarray], threshold_bytes: int) -> list[list[int]]:
    """Returns lists of indices into ``arrays``; each list is one bucket.

    A bucket holds arrays of a single dtype whose total size stays within
    ``threshold_bytes``; an array larger than the threshold is a bucket alone.
    Empty arrays are left out: they need no communication.
    """
    by_dtype: dict[np.dtype, list[int]] = {}
    for index, array in enumerate(arrays):
        if array.size:
            by_dtype.setdefault(array.dtype, []).append(index)
    buckets: list[list[int]] = []
    for indices in by_dtype.values():
        current: list[int] = []
        current_bytes = 0
        for index in indices:
            nbytes = arrays[index].nbytes
            if current and current_bytes + nbytes > threshold_bytes:
                buckets.append(current)
                current, current_bytes = [], 0
            current.append(index)
            current_bytes += nbytes
        if current:
            buckets.append(current)
    return buckets


def pack(arrays: Sequence[np.ndarray], out: np.ndarray, scale: float = 1.0) -> None:
    """Copies ``arrays`` end to end into the flat ``out`` (times ``scale``)."""
    offset = 0
    for array in arrays:
        target = out[offset : offset + array.size].reshape(array.shape)
        if scale == 1.0:
            np.copyto(target, array, casting="same_kind")
        else:
            np.multiply(array, scale, out=target, casting="unsafe")
        offset += array.size


def unpack(flat: np.ndarray, like: Sequence[np.ndarray], scale: float = 1.0,
           out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
    """Splits ``flat`` into arrays shaped like ``like`` (times ``scale``).

    The results are ``out`` when given (arrays shaped like ``like``, written
    in place), else fresh arrays.
    """
    outputs = []
    offset = 0
    for index, array in enumerate(like):
        piece = flat[offset : offset + array.size].reshape(array.shape)
        target = np.empty(array.shape, array.dtype) if out is None else out[index]
        if scale == 1.0:
            np.copyto(target, piece, casting="unsafe")
        else:
            np.multiply(piece, scale, out=target, casting="unsafe")
        outputs.append(target)
        offset += array.size
    return outputs


#: Where ``aligned_like`` starts each array: TensorFlow takes a numpy array
#: returned by ``tf.numpy_function`` without copying it only when its data
#: starts on a multiple of this (EIGEN_MAX_ALIGN_BYTES); otherwise it copies
#: every output.
ALIGN_BYTES = 64
#: Grouped results from this size on come from ``outputs.POOL``: a training
#: step's gradients have the same size every step, and a fresh buffer each step
#: cost the pages' faults again whenever glibc had given the last one back.
GROUP_POOL_MIN_BYTES = 256 << 10
_BYTE = np.dtype(np.uint8)


class AlignedViews(list):
    """``aligned_like``'s arrays, with ``region``: the bytes that hold them all
    (a uint8 array; array ``i`` starts at ``aligned_offsets(...)[0][i]``), which
    a traced TensorFlow step takes as one output (``tf.graph_buffer``)."""

    region: np.ndarray


def aligned_offsets(nbytes: Sequence[int]) -> tuple[list[int], int]:
    """Where ``aligned_like`` puts arrays of these sizes: their offsets, each a
    multiple of ``ALIGN_BYTES``, and the bytes the region spans."""
    offsets = []
    total = 0
    for size in nbytes:
        offsets.append(total)
        total += -(-size // ALIGN_BYTES) * ALIGN_BYTES
    return offsets, total


def aligned_like(arrays: Sequence[np.ndarray]) -> AlignedViews:
    """Uninitialised arrays shaped like ``arrays``, views of one new buffer,
    each starting on an ``ALIGN_BYTES`` boundary: one allocation for a whole
    group of outputs, which TensorFlow adopts without copying."""
    return aligned_views(arrays, *aligned_offsets([array.nbytes for array in arrays]))


def aligned_views(arrays: Sequence[np.ndarray], offsets: Sequence[int],
                  total: int) -> AlignedViews:
    """``aligned_like(arrays)`` given ``aligned_offsets`` of their sizes."""
    raw = outputs.POOL.empty((total + ALIGN_BYTES,), _BYTE, min_bytes=GROUP_POOL_MIN_BYTES)
    views = AlignedViews()
    start = _native.fill_views(views, raw, ALIGN_BYTES, offsets, arrays)
    views.region = raw[start : start + total]
    return views
