"""TensorFlow GPU tensors on the device path: DLPack to cupy and back.

Imported only when a TensorFlow value may take the device path
(``device_path.device_path``, and the ``tf.py_function`` op ``conversions.run``
builds inside a traced step when TensorFlow sees a GPU and cupy is usable),
and when a TF1 graph gets a collective (``number_gpus_as_sessions``).

Which tensors: those whose memory is on a GPU, as their DLPack export says.
A tensor's ``device`` is where its op ran, not where its memory is:
TensorFlow keeps int32 tensors placed on a GPU in host memory, and cupy
refuses their capsules. Such tensors take the host path.

Device numbers: TensorFlow's are logical (after Horovod's pinning recipe a
rank's only GPU is ``GPU:0`` whatever CUDA device it is). The CUDA device of
a tensor is read once per logical GPU from where its memory is, and each
capsule is rewritten to it on the way to cupy and back to TensorFlow's
number on the way back (``dlpack``).

Ordering: TensorFlow does not expose the CUDA stream its kernels run on, and
its DLPack export carries no stream. So the hand-over has one synchronisation
point each way, per collective call (not per tensor): the tensors' GPU is
synchronised before they are read (every kernel TensorFlow has queued there
has finished, the gradients included; other GPUs are left alone), and, once
the collective has completed, cupy's current stream is synchronised before
the results are handed back (TensorFlow's kernels then read finished data).
Between the two, cupy and NCCL order their own work by events.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_dist.tensor import dlpack, gpu

#: TensorFlow's logical GPU number -> its CUDA device, as found from memory.
_CUDA_DEVICE: dict[int, int] = {}


def on_gpu(tensor) -> bool:
    """True when the (eager) tensor's memory is on a GPU."""
    if "GPU" not in (tensor.device or "").upper():
        return False
    return tensor.__dlpack_device__()[0] == dlpack.KDL_CUDA


def gpu_visible() -> bool:
    """True when TensorFlow sees a GPU (a traced step may then place ops on it)."""
    return bool(tf.config.list_logical_devices("GPU"))


def number_gpus_as_sessions(local_rank: int, local_size: int) -> None:
    """Makes TensorFlow's eager runtime see only the GPU at ``local_rank``, as
    Horovod's TF1 recipe pins a session (``visible_device_list =
    str(local_rank)``), where the user has not chosen its GPUs and it has
    not started.

    A session runs keras_dist's host ops through TensorFlow's eager runtime,
    which starts then and numbers the GPUs it sees from 0. TensorFlow holds
    one numbering per process: a runtime that saw every GPU would call CUDA
    device 0 ``GPU:0`` where a session pinned to local rank 1 calls CUDA
    device 1 so, and TensorFlow refuses whichever comes second ("is being
    mapped to multiple devices"). With one rank on the machine, fewer GPUs
    than ranks, or one GPU, nothing changes.
    """
    if local_size < 2:
        return
    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) < local_size or tf.config.get_visible_devices("GPU") != gpus:
        return
    try:
        tf.config.set_visible_devices(gpus[local_rank], "GPU")
    except RuntimeError:  # the runtime has started: its numbering stands
        pass


def device_module(tensors):
    """cupy when every (eager) tensor is in GPU memory, of a dtype the device
    path carries, and cupy is usable; None otherwise (the host path)."""
    if not all(on_gpu(t) for t in tensors):
        return None
    return gpu.device_module(t.dtype.as_numpy_dtype for t in tensors)


def cuda_device(tensor, xp) -> int:
    """The CUDA device holding ``tensor``'s memory (``xp`` numpy: its DLPack number)."""
    logical = tensor.__dlpack_device__()[1]
    if xp is np:
        return logical
    if logical not in _CUDA_DEVICE:
        pointer = dlpack.data_pointer(tf.experimental.dlpack.to_dlpack(tensor))
        if not pointer:  # no memory to ask about: the current device serves
            return xp.cuda.Device().id
        _CUDA_DEVICE[logical] = xp.cuda.runtime.pointerGetAttributes(pointer).device
    return _CUDA_DEVICE[logical]


def device_scope(tensors, xp):
    """cupy on the tensors' GPU (cupy's own stream: TensorFlow's is not exposed)."""
    return gpu.device_scope(xp, cuda_device(tensors[0], xp))


class _Export:
    """A TensorFlow tensor's DLPack capsule behind the ``__dlpack__`` protocol,
    naming the CUDA device ``device_id``.

    TensorFlow's export ignores streams; ``to_device_arrays`` has synchronised
    the device first, so the consumer's stream argument is not needed.
    """

    def __init__(self, tensor, device_id: int) -> None:
        device_type, logical = tensor.__dlpack_device__()
        self._device = (device_type, device_id)
        self._capsule = tf.experimental.dlpack.to_dlpack(tensor)
        if logical != device_id:
            dlpack.set_device_id(self._capsule, device_id)

    def __dlpack_device__(self):
        return self._device

    def __dlpack__(self, stream=None, **kwargs):
        return self._capsule


def synchronize(xp, device_id: int) -> None:
    """Waits for the work queued on GPU ``device_id``, TensorFlow's included (its
    streams are on that device); other GPUs are left alone."""
    if xp is not np:
        xp.cuda.Device(device_id).synchronize()


def to_device_arrays(tensors, xp) -> list:
    """The tensors as ``xp`` arrays sharing their memory, after TensorFlow's
    queued work on their GPU."""
    device_id = cuda_device(tensors[0], xp)
    synchronize(xp, device_id)
    return [xp.from_dlpack(_Export(t, device_id)) for t in tensors]


def from_device_arrays(arrays, templates, xp) -> list:
    """``xp`` arrays as TensorFlow tensors sharing their memory, once finished,
    on their templates' (logical) GPU."""
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()
    results = []
    for array, template in zip(arrays, templates):
        capsule = array.__dlpack__()
        logical = template.__dlpack_device__()[1]
        if dlpack.device(capsule)[1] != logical:
            dlpack.set_device_id(capsule, logical)
        results.append(tf.experimental.dlpack.from_dlpack(capsule))
    return results


def memory_notice(growth_setting: str | None) -> str | None:
    """Why NCCL and cupy may find no GPU memory left, or None.

    TensorFlow reserves nearly all of a GPU's memory when it starts using it,
    unless memory growth is on (``tf.config.experimental.set_memory_growth``
    or ``TF_FORCE_GPU_ALLOW_GROWTH=true``) or the user gave it a memory limit.
    Turns growth on where TensorFlow has not started; ``growth_setting`` is
    ``TF_FORCE_GPU_ALLOW_GROWTH`` as it was before ``kd.init()``.
    """
    for device in tf.config.list_physical_devices("GPU"):
        if (tf.config.experimental.get_memory_growth(device)
                or tf.config.get_logical_device_configuration(device)):
            continue
        try:
            tf.config.experimental.set_memory_growth(device, True)
        except RuntimeError:  # TensorFlow has started using its GPUs
            if (growth_setting or "").strip().lower() != "true":
                return ("keras_dist: TensorFlow started using its GPUs before kd.init() "
                        "without memory growth and holds nearly all their memory, so NCCL and "
                        "keras_dist's fusion buffers may run out of it. Call kd.init() before "
                        "TensorFlow's first op, or turn on memory growth "
                        "(tf.config.experimental.set_memory_growth(gpu, True)) first.")
            return None
    return None
