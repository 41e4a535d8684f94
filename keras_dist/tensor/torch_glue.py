"""PyTorch tensors in the tensor layer: to numpy and back, without copies on the CPU.

Imported only when a torch tensor reaches a collective. A CPU tensor's numpy
view shares its memory (``Tensor.numpy``). CUDA tensors of the dtypes the
device path carries go to cupy and back by DLPack, without a host copy, on
torch's current stream (the ``device_*`` functions, used by
``device_path.device_path``); others (bfloat16, or cupy missing) go through
host memory. bfloat16, which numpy lacks,
is viewed as ``ml_dtypes.bfloat16`` through its int16 bits, still without a
copy. Results come back as tensors on the input's device; collectives on
torch tensors are not recorded by autograd (their results are detached, as
gradients are when the optimizer reduces them).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from keras_dist._vocab import bfloat16_dtype
from keras_dist.tensor import gpu
from keras_dist.tensor.counters import COUNTERS


def numpy_dtype(tensor) -> np.dtype:
    if tensor.dtype == torch.bfloat16:
        return bfloat16_dtype()
    return torch.empty((), dtype=tensor.dtype).numpy().dtype


def to_numpy(tensor) -> np.ndarray:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        COUNTERS["device_to_host"] += 1
        tensor = tensor.cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(numpy_dtype(tensor))
    return tensor.numpy()


def like(template, array: np.ndarray):
    """``array`` as a tensor on ``template``'s device."""
    if not array.flags.c_contiguous or not array.flags.writeable:
        array = array.copy()  # torch.from_numpy needs both (and keeps 0-d shapes)
    if array.dtype == bfloat16_dtype():
        result = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
        result = torch.from_numpy(array)
    return result if template.device.type == "cpu" else result.to(template.device)


def cast(tensor, dtype):
    dtype = np.dtype(dtype)
    if dtype == bfloat16_dtype():
        return tensor.to(torch.bfloat16)
    return tensor.to(torch.from_numpy(np.empty(0, dtype)).dtype)


# ---------------------------------------------------------------------------
# The device path (``device_path.device_path``).


def device_module(tensors):
    """cupy when every tensor is a CUDA tensor the device path carries and cupy
    imports; None otherwise (the host path)."""
    if not all(t.device.type == "cuda" for t in tensors):
        return None
    return gpu.device_module(numpy_dtype(t) for t in tensors)


def device_scope(tensors, xp):
    """cupy on the tensors' GPU and on torch's current stream there: the
    DLPack hand-overs and the collective are ordered after the work that
    produced the tensors, and before the work that reads the results, without
    any synchronisation."""
    if xp is np:
        return contextlib.nullcontext()
    device = tensors[0].device
    return gpu.device_scope(xp, device.index, torch.cuda.current_stream(device).cuda_stream)


def to_device_arrays(tensors, xp) -> list:
    """The tensors as ``xp`` arrays sharing their memory (DLPack)."""
    return [xp.from_dlpack(t.detach()) for t in tensors]


def from_device_arrays(arrays, templates, xp) -> list:
    """``xp`` arrays as torch tensors sharing their memory (DLPack), on their device."""
    return [torch.from_dlpack(a) for a in arrays]
