"""Device arrays (cupy) through the group's GPU data plane.

The tensor layer hands device arrays here, already validated: cupy arrays
from the user, or framework tensors (TensorFlow, PyTorch, JAX on a GPU)
handed over by DLPack (``conversions.device_path``). They are fused by dtype
on the device (each member starting on an ``ALIGN_BYTES`` boundary, so
every result is an aligned view of it), and each fused buffer is reduced by the transport
``KERAS_DIST_GPU_OPERATIONS`` chooses (``transports.gpu_transport``): NCCL,
without a trip through host memory, or the CPU transport with the buffer
staged in host memory. The result stays on the device either way. The work
is queued on the caller's current stream; ``complete`` is waited for once
per call, boundedly (a dead peer or a stall raises).

The code uses only what numpy and cupy share (``concatenate``, slicing,
in-place arithmetic), so the CPU tests run it on numpy arrays.
"""

from __future__ import annotations

import contextlib

import numpy as np

from keras_dist import _vocab, transports
from keras_dist._runtime import context, timeline
from keras_dist.tensor import fusion

#: dtypes the device path carries: NCCL's, less bfloat16 (cupy has no bfloat16;
#: bfloat16 framework tensors take the host path).
DEVICE_DTYPE_CODES = frozenset({_vocab.UINT8, _vocab.INT32, _vocab.INT64, _vocab.FLOAT16,
                                _vocab.FLOAT32, _vocab.FLOAT64})


def carries(dtypes) -> bool:
    """True when the device path can carry every dtype of ``dtypes``."""
    return all(_vocab.is_supported(d) and _vocab.dtype_code(d) in DEVICE_DTYPE_CODES
               for d in dtypes)


def cupy_or_none():
    """The cupy module, or None when it does not import (the host path then serves)."""
    try:
        import cupy
    except ImportError:
        return None
    return cupy


@contextlib.contextmanager
def device_scope(xp, device_id: int, stream_pointer: int | None = None):
    """Makes GPU ``device_id`` cupy's current device, and the framework's stream
    (``stream_pointer``, a ``cudaStream_t``; None: cupy's own) its current stream,
    for this thread. A no-op for numpy (the CPU tests)."""
    if xp is np:
        yield
        return
    with xp.cuda.Device(device_id):
        if stream_pointer is None:
            yield
        else:
            with xp.cuda.ExternalStream(stream_pointer, device_id):
                yield


#: Where each result starts, in bytes: frameworks take device memory by DLPack
#: only when aligned (TensorFlow aborts on a tensor not on a multiple of
#: EIGEN_MAX_ALIGN_BYTES, 64); cupy allocates on multiples of 256.
ALIGN_BYTES = 256


def _address(array) -> int:
    return array.data.ptr if hasattr(array.data, "ptr") else array.ctypes.data


def _aligned_zeros(xp, count: int, dtype):
    """``count`` zeros of ``dtype`` starting on an ``ALIGN_BYTES`` boundary."""
    itemsize = np.dtype(dtype).itemsize
    raw = xp.zeros(count + ALIGN_BYTES // itemsize, dtype)
    skip = (-_address(raw) % ALIGN_BYTES) // itemsize
    return raw[skip : skip + count]


def _layout(members) -> tuple[list[int], int]:
    """Each member's offset in a fused buffer where each starts aligned; the total."""
    offsets, total = [], 0
    for member in members:
        per_unit = ALIGN_BYTES // member.dtype.itemsize
        total = -(-total // per_unit) * per_unit
        offsets.append(total)
        total += member.size
    return offsets, total


def _array_module(value):
    if type(value).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def grouped_allreduce(values: list, op: _vocab.ReduceOp, prescale: float, postscale: float,
                      compression, counters: dict[str, int], name: str = "allreduce",
                      group=None, labels: list[str] | None = None) -> list:
    """``values`` (cupy arrays) reduced across ranks; cupy arrays on the same device out.

    On the timeline the call is one collective span (``labels``: the tensors'
    names; default those of ``timeline.tensor_names``), from the first fused
    buffer to the host's wait for the last; a GPU transport does not split it
    into waiting and moving data.
    """
    group = group or context.get()
    compressed, contexts = zip(*(compression.compress(v) for v in values))
    xp = _array_module(compressed[0])
    if group.size == 1:
        results = list(compressed)
        if prescale != 1.0 or postscale != 1.0:
            for index, value in enumerate(compressed):
                result = _aligned_zeros(xp, value.size, value.dtype).reshape(value.shape)
                result[...] = value
                _vocab.scale_in_place(result, prescale, xp)
                _vocab.scale_in_place(result, postscale, xp)
                results[index] = result
    else:
        transport = transports.gpu_transport(group)
        results = list(compressed)
        threshold = group.config.fusion_threshold_bytes
        with timeline.activity(name, "allreduce", sum(v.nbytes for v in compressed), transport,
                               labels):
            for bucket in fusion.plan_buckets(compressed, threshold):
                members = [compressed[i] for i in bucket]
                offsets, total = _layout(members)
                flat = _aligned_zeros(xp, total, members[0].dtype)  # zeros between members
                for offset, member in zip(offsets, members):
                    flat[offset : offset + member.size] = member.ravel()
                _vocab.scale_in_place(flat, prescale, xp)
                transport.allreduce(flat, _vocab.TRANSPORT_OPS[op], name=f"{name} {op.value}")
                counters["allreduce"] += 1
                _vocab.finish_reduction(flat, op, group.size, postscale, xp)
                for index, offset, member in zip(bucket, offsets, members):
                    results[index] = flat[offset : offset + member.size].reshape(member.shape)
            transport.complete(f"{name} {op.value} of {len(values)} tensors")
    return [compression.decompress(r, c) for r, c in zip(results, contexts)]
