"""Horovod's capability queries, answered for this package.

keras_dist has no build-time options: MPI comes from mpi4py (always a
dependency), the GPU data plane from cupy's NCCL when cupy is installed.
Gloo, DDL and oneCCL are not part of keras_dist, so their queries say False.
"""

from __future__ import annotations

import importlib.util

from keras_dist._runtime import context


def mpi_built() -> bool:
    """True: MPI (through mpi4py) is keras_dist's control plane."""
    return importlib.util.find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    """True once ``init()`` has run: every process group runs on MPI."""
    return context.is_initialized()


def mpi_threads_supported() -> bool:
    """Whether the MPI library runs with ``MPI_THREAD_MULTIPLE``.

    Raises:
        ValueError: ``init()`` has not been called.
    """
    if not context.is_initialized():
        raise ValueError("keras_dist has not been initialised: call `keras_dist.init()` "
                         "before `mpi_threads_supported()`.")
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def gloo_built() -> bool:
    """False: keras_dist has no Gloo controller (MPI serves, also across machines)."""
    return False


def gloo_enabled() -> bool:
    """False: see ``gloo_built``."""
    return False


def _cupy():
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def nccl_built() -> int:
    """The NCCL version code (e.g. 22105) cupy's NCCL reports, or 0 without it.

    As in Horovod, a number: non-zero means the NCCL data plane is available.
    """
    if _cupy() is None:
        return 0
    try:
        from cupy.cuda import nccl
    except ImportError:
        return 0
    if not getattr(nccl, "available", True):
        return 0
    try:
        return int(nccl.get_version())
    except Exception:  # noqa: BLE001 - cupy raises its own CUDA errors without a driver
        return 0


def cuda_built() -> bool:
    """True when cupy for CUDA is installed (GPU values and the NCCL data plane)."""
    cupy = _cupy()
    return cupy is not None and not getattr(cupy.cuda.runtime, "is_hip", False)


def rocm_built() -> bool:
    """True when cupy for ROCm is installed."""
    cupy = _cupy()
    return cupy is not None and bool(getattr(cupy.cuda.runtime, "is_hip", False))


def ddl_built() -> bool:
    """False: IBM DDL is not supported."""
    return False


def ccl_built() -> bool:
    """False: oneCCL is not supported."""
    return False
