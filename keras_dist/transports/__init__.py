"""Transports: one class per module, all implementing ``base.Transport``.

This package also chooses the transport for a process group
(``cpu_transport``, ``gpu_transport``): the settings say which data plane,
the topology says which can serve.
"""

from __future__ import annotations

from keras_dist._config import Config
from keras_dist.errors import TransportError
from keras_dist.transports.base import Transport


def cpu_transport(config: Config, comm, local_comm, cross_comm) -> Transport:
    """The CPU data plane for a group (``KERAS_DIST_CPU_OPERATIONS``).

    Args:
        config: the settings.
        comm: the group's communicator.
        local_comm: the ranks on this machine.
        cross_comm: the ranks with this rank's local rank, one per machine.
    """
    if comm.Get_size() == 1:
        from keras_dist.transports.local import LocalTransport

        return LocalTransport()
    want = config.cpu_operations
    if want == "auto":
        want = "shm" if local_comm.Get_size() > 1 and native_available() else "mpi"
    if want == "mpi":
        from keras_dist.transports.mpi import MpiTransport

        return MpiTransport(comm, local_comm, config)
    if not native_available():
        raise TransportError(
            "KERAS_DIST_CPU_OPERATIONS=shm needs the native extension keras_dist._native, "
            "which failed to import. Reinstall keras_dist, or set KERAS_DIST_CPU_OPERATIONS=mpi."
        )
    from keras_dist.transports.shm import ShmTransport

    return ShmTransport(local_comm, cross_comm if cross_comm.Get_size() > 1 else None, config)


def native_available() -> bool:
    """True when the native extension (and so the shm transport) imports."""
    try:
        from keras_dist import _native  # noqa: F401
        from keras_dist.transports import shm  # noqa: F401
    except ImportError:
        return False
    return True


def gpu_transport(group) -> Transport:
    """The group's NCCL transport, created on first use (it needs a GPU and cupy)."""
    if group.gpu_transport is None:
        from keras_dist.transports.nccl import NcclTransport

        group.gpu_transport = NcclTransport(group.comm, group.local_rank)
    return group.gpu_transport
