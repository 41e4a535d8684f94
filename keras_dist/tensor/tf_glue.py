"""TensorFlow GPU tensors on the device path: DLPack to cupy and back.

Imported only when a TensorFlow value may take the device path
(``conversions.device_path``, and the ``tf.py_function`` op ``conversions.run``
builds inside a traced step when TensorFlow sees a GPU and cupy imports).

Ordering: TensorFlow does not expose the CUDA stream its kernels run on, and
its DLPack export carries no stream. So the hand-over has one documented
synchronisation point each way, per collective call (not per tensor):
``tf.test.experimental.sync_devices()`` before the tensors are read (every op
TensorFlow has queued has finished, the gradients included), and, once the
collective has completed, a synchronisation of cupy's current stream before
the results are handed back (TensorFlow's kernels then read finished data).
Between the two, cupy and NCCL order their own work by events.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_dist.tensor import gpu


def _on_gpu(tensor) -> bool:
    return "GPU" in (tensor.device or "").upper()


def gpu_visible() -> bool:
    """True when TensorFlow sees a GPU (a traced step may then place ops on it)."""
    return bool(tf.config.list_logical_devices("GPU"))


def device_module(tensors):
    """cupy when every (eager) tensor is on a GPU, of a dtype the device path
    carries, and cupy imports; None otherwise (the host path)."""
    if not all(_on_gpu(t) for t in tensors):
        return None
    if not gpu.carries(t.dtype.as_numpy_dtype for t in tensors):
        return None
    return gpu.cupy_or_none()


def device_scope(tensors, xp):
    """cupy on the tensors' GPU (cupy's own stream: TensorFlow's is not exposed)."""
    return gpu.device_scope(xp, tensors[0].__dlpack_device__()[1])


class _Export:
    """A TensorFlow tensor's DLPack capsule behind the ``__dlpack__`` protocol.

    TensorFlow's export ignores streams; ``to_device_arrays`` has synchronised
    the devices first, so the consumer's stream argument is not needed.
    """

    def __init__(self, tensor) -> None:
        self._device = tensor.__dlpack_device__()
        self._capsule = tf.experimental.dlpack.to_dlpack(tensor)

    def __dlpack_device__(self):
        return self._device

    def __dlpack__(self, stream=None, **kwargs):
        return self._capsule


def to_device_arrays(tensors, xp) -> list:
    """The tensors as ``xp`` arrays sharing their memory, after TensorFlow's queued work."""
    tf.test.experimental.sync_devices()
    return [xp.from_dlpack(_Export(t)) for t in tensors]


def from_device_arrays(arrays, templates, xp) -> list:
    """``xp`` arrays as TensorFlow tensors sharing their memory, once finished."""
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()
    return [tf.experimental.dlpack.from_dlpack(a.__dlpack__()) for a in arrays]
