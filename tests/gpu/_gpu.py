"""What every GPU test module starts with: cupy, or a skip that says why."""

import pytest


def gpu_count(cupy) -> int:
    """The CUDA GPUs ``cupy`` sees (0 where the driver fails)."""
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - a CUDA driver error means no usable GPU
        return 0


def cupy_with_a_gpu():
    """cupy, once it imports and sees a CUDA GPU; otherwise skips the calling
    test module, saying what is missing."""
    cupy = pytest.importorskip("cupy",
                               reason="needs cupy (pip install cupy-cuda12x nvidia-nccl-cu12)")
    if gpu_count(cupy) == 0:
        pytest.skip("needs a CUDA GPU; none is visible", allow_module_level=True)
    return cupy
