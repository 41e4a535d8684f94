"""PyTorch tensors in the tensor layer: to numpy and back, without copies on the CPU.

Imported only when a torch tensor reaches a collective. A CPU tensor's numpy
view shares its memory (``Tensor.numpy``); a GPU tensor goes through host
memory here (the NCCL path takes cupy arrays). bfloat16, which numpy lacks,
is viewed as ``ml_dtypes.bfloat16`` through its int16 bits, still without a
copy. Results come back as tensors on the input's device; collectives on
torch tensors are not recorded by autograd (their results are detached, as
gradients are when the optimizer reduces them).
"""

from __future__ import annotations

import numpy as np
import torch

from keras_dist._vocab import _bfloat16


def numpy_dtype(tensor) -> np.dtype:
    if tensor.dtype == torch.bfloat16:
        if _bfloat16 is None:
            raise TypeError("A bfloat16 torch tensor needs the ml_dtypes package "
                            "(pip install ml_dtypes). Received: dtype=torch.bfloat16")
        return np.dtype(_bfloat16)
    return torch.empty((), dtype=tensor.dtype).numpy().dtype


def to_numpy(tensor) -> np.ndarray:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(numpy_dtype(tensor))
    return tensor.numpy()


def like(template, array: np.ndarray):
    """``array`` as a tensor on ``template``'s device."""
    if not array.flags.c_contiguous or not array.flags.writeable:
        array = array.copy()  # torch.from_numpy needs both (and keeps 0-d shapes)
    if _bfloat16 is not None and array.dtype == np.dtype(_bfloat16):
        result = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
        result = torch.from_numpy(array)
    return result if template.device.type == "cpu" else result.to(template.device)


def cast(tensor, dtype):
    dtype = np.dtype(dtype)
    if _bfloat16 is not None and dtype == np.dtype(_bfloat16):
        return tensor.to(torch.bfloat16)
    return tensor.to(torch.from_numpy(np.empty(0, dtype)).dtype)
