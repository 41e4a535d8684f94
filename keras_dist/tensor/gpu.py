"""Device arrays (cupy) through the group's GPU data plane.

The tensor layer hands device arrays here, already validated: cupy arrays
from the user, or framework tensors (TensorFlow, PyTorch, JAX on a GPU)
handed over by DLPack (``device_path.device_path``). They are fused by dtype
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
import functools
import warnings

import numpy as np

from keras_dist import _vocab, transports
from keras_dist._runtime import context, timeline
from keras_dist.errors import TransportError
from keras_dist.tensor import fusion

#: dtypes the device path carries (NCCL's); bfloat16 too where cupy has it
#: (``carries``).
DEVICE_DTYPE_CODES = frozenset({_vocab.UINT8, _vocab.INT32, _vocab.INT64, _vocab.FLOAT16,
                                _vocab.FLOAT32, _vocab.FLOAT64})


def carries(dtypes, xp=None) -> bool:
    """True when the device path can carry every dtype of ``dtypes`` (with
    ``xp``, the array module that would: bfloat16 where it has that dtype,
    asked only when a bfloat16 value comes)."""
    dtypes = list(dtypes)
    if not all(_vocab.is_supported(d) for d in dtypes):
        return False
    codes = {_vocab.dtype_code(d) for d in dtypes}
    if _vocab.BFLOAT16 in codes and xp is not None and xp is not np and _has_bfloat16(xp):
        codes.discard(_vocab.BFLOAT16)
    return codes <= DEVICE_DTYPE_CODES


@functools.cache
def _has_bfloat16(xp) -> bool:
    """Whether cupy makes, scales, copies and hands over bfloat16 arrays (cupy 14
    does; older releases lack the dtype: bfloat16 values then take the host path)."""
    try:
        probe = xp.zeros(4, _vocab.bfloat16_dtype())
        probe[1:3] = xp.ones(2, _vocab.bfloat16_dtype())
        _vocab.scale_in_place(probe, 3.0, xp)
        return float(xp.from_dlpack(probe)[1].astype(np.float32)) == 3.0
    except Exception:  # noqa: BLE001 - any failure means cupy cannot carry it
        return False


def device_module(dtypes):
    """cupy when GPU values of ``dtypes`` can take the device path: cupy is
    usable (``usable_cupy``) and carries every dtype; None otherwise (the host
    path)."""
    xp = usable_cupy()
    if xp is None or not carries(list(dtypes), xp):
        return None
    return xp


@functools.cache
def _cupy_or_reason() -> tuple[object | None, str | None]:
    """``(cupy, None)`` when cupy imports and reaches a GPU, else ``(None, why not)``."""
    try:
        import cupy
    except ImportError as error:
        return None, (f"cupy does not import ({error}; pip install cupy-cuda12x "
                      "nvidia-nccl-cu12, or the cuda13 pair: the extras cuda12 and cuda13 "
                      "of keras_dist's pyproject.toml)")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # noqa: BLE001 - cupy raises its own CUDA errors
        return None, (f"cupy {cupy.__version__} imports but cannot use CUDA "
                      f"({type(error).__name__}: {error})")
    if count == 0:
        return None, f"cupy {cupy.__version__} sees no GPU"
    return cupy, None


_NOTICES: set[str] = set()


def usable_cupy():
    """cupy, when GPU values can go to it; else None, with a one-time notice that
    GPU values are reduced through host memory, and why.

    Raises:
        TransportError: ``KERAS_DIST_GPU_OPERATIONS=nccl`` asked for the GPU
            data plane and cupy cannot serve it (never a silent fallback).
    """
    cupy, reason = _cupy_or_reason()
    if cupy is not None:
        return cupy
    if context.is_initialized() and context.get().config.gpu_operations == "nccl":
        raise TransportError(
            "KERAS_DIST_GPU_OPERATIONS=nccl asks for NCCL, but GPU values cannot reach it: "
            f"{reason}. Install cupy with NCCL, or set KERAS_DIST_GPU_OPERATIONS=mpi to "
            "reduce GPU values through host memory.")
    if reason not in _NOTICES:
        _NOTICES.add(reason)
        warnings.warn(f"keras_dist: GPU values are reduced through host memory: {reason}.",
                      RuntimeWarning, stacklevel=3)
    return None


@functools.lru_cache(maxsize=64)
def _external_stream(xp, stream_pointer: int, device_id: int):
    """cupy's wrapper of a framework's stream, made once per stream: cupy 14
    deprecates ``ExternalStream`` (a warning at each construction)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return xp.cuda.ExternalStream(stream_pointer, device_id)


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
            with _external_stream(xp, stream_pointer, device_id):
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


def _device_id(array) -> int:
    """The GPU ``array`` is on (0 for the numpy arrays of the CPU tests)."""
    device = getattr(array, "device", None)
    return getattr(device, "id", 0) or 0


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
    if group.size == 1 and group.config.size_one_shortcut:
        results = list(compressed)
        if prescale != 1.0 or postscale != 1.0:
            for index, value in enumerate(compressed):
                result = _aligned_zeros(xp, value.size, value.dtype).reshape(value.shape)
                result[...] = value
                _vocab.scale_in_place(result, prescale, xp)
                _vocab.scale_in_place(result, postscale, xp)
                results[index] = result
    else:
        transport = transports.gpu_transport(group, _device_id(compressed[0]))
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
                counters["gpu_allreduce"] += 1
                if transport.stages_through_host:
                    counters["device_to_host"] += 1
                _vocab.finish_reduction(flat, op, group.size, postscale, xp)
                for index, offset, member in zip(bucket, offsets, members):
                    results[index] = flat[offset : offset + member.size].reshape(member.shape)
            transport.complete(f"{name} {op.value} of {len(values)} tensors")
    return [compression.decompress(r, c) for r, c in zip(results, contexts)]
