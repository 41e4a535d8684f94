"""Reading and retargeting DLPack capsules (``DLManagedTensor``) in place.

TensorFlow numbers its GPUs logically: after Horovod's pinning recipe
(``tf.config.set_visible_devices(gpus[local_rank], "GPU")``) the one GPU a
rank sees is TensorFlow's ``GPU:0`` while its memory is on CUDA device
``local_rank``, and TensorFlow's capsules carry the logical number both
ways. cupy takes a capsule's device number as a CUDA device, so ``tf.glue``
rewrites it: to the CUDA device on the way to cupy, back to TensorFlow's
number on the way back. The layout is DLPack's ABI (``dlpack.h``), stable
since its first release: a capsule named ``dltensor`` holds a
``DLManagedTensor`` whose first member is the ``DLTensor``; one named
``dltensor_versioned`` holds a ``DLManagedTensorVersioned``, whose
``DLTensor`` follows a version, a context, a deleter and flags.
"""

from __future__ import annotations

import ctypes

#: ``DLDeviceType`` values.
KDL_CPU, KDL_CUDA = 1, 2

#: Where the ``DLTensor`` starts, by capsule name.
_TENSOR_OFFSET = {b"dltensor": 0, b"dltensor_versioned": 32}
#: ``DLTensor``: ``void *data`` at 0, ``DLDevice {int32 type; int32 id}`` at 8.
_DATA, _DEVICE_TYPE, _DEVICE_ID = 0, 8, 12

_get_name = ctypes.pythonapi.PyCapsule_GetName
_get_name.restype = ctypes.c_char_p
_get_name.argtypes = [ctypes.py_object]
_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _tensor_address(capsule) -> int:
    name = _get_name(capsule)
    if name not in _TENSOR_OFFSET:
        raise ValueError(
            "A DLPack capsule must be unconsumed and named 'dltensor' or "
            f"'dltensor_versioned'. Received: a capsule named {name!r}")
    return _get_pointer(capsule, name) + _TENSOR_OFFSET[name]


def data_pointer(capsule) -> int:
    """The address of the capsule's data (``DLTensor.data``; 0 for no data)."""
    return ctypes.c_void_p.from_address(_tensor_address(capsule) + _DATA).value or 0


def device(capsule) -> tuple[int, int]:
    """The capsule's ``(device type, device number)``."""
    address = _tensor_address(capsule)
    return (ctypes.c_int32.from_address(address + _DEVICE_TYPE).value,
            ctypes.c_int32.from_address(address + _DEVICE_ID).value)


def set_device_id(capsule, device_id: int) -> None:
    """Makes the capsule name device ``device_id`` (its type unchanged)."""
    ctypes.c_int32.from_address(_tensor_address(capsule) + _DEVICE_ID).value = device_id
