"""Transports: one class per module, all implementing ``base.Transport``.

This package also chooses the transport for a process group
(``cpu_transport``, ``gpu_transport``): the settings say which data plane,
the topology says which can serve.
"""

from __future__ import annotations

from collections.abc import Sequence

from keras_dist._config import Config
from keras_dist.errors import TransportError
from keras_dist.transports.base import Transport


def cpu_transport(config: Config, comm, local_comm, cross_comm, *,
                  rank_names: Sequence[int] | None = None) -> Transport:
    """The CPU data plane for a group (``KERAS_DIST_CPU_OPERATIONS``), able to ``join``.

    ``shm``: the shm transport when the group runs on one machine, the
    hierarchical one (shm inside each machine, MPI among them) when it spans
    several. ``mpi``: the MPI transport. ``auto``: ``shm`` when the native
    extension imports on every rank and some machine runs more than one rank,
    else ``mpi``. Collective over ``comm``: every rank makes the same choice.

    Args:
        config: the settings.
        comm: the group's communicator (its ranks are the transport's).
        local_comm: the ranks on this machine.
        cross_comm: the ranks with this rank's local rank, one per machine.
        rank_names: what messages call each rank of ``comm`` (its job rank,
            for a process set); defaults to its rank in ``comm``. The shm and
            MPI transports use them.

    Raises:
        TransportError: ``shm`` was asked for and the native extension is missing.
    """
    if comm.Get_size() == 1:
        from keras_dist.transports.local import LocalTransport

        return LocalTransport()
    from keras_dist.transports.joinable import JoinableTransport

    return JoinableTransport(_cpu_data_plane(config, comm, local_comm, cross_comm, rank_names),
                             comm.Get_rank(), comm.Get_size())


def _cpu_data_plane(config: Config, comm, local_comm, cross_comm,
                    rank_names: Sequence[int] | None) -> Transport:
    """The transport ``cpu_transport`` wraps: the choice it describes."""
    want = config.cpu_operations
    if want == "auto":
        everyone = comm.allgather((local_comm.Get_size(), native_available()))
        shared = any(local_size > 1 for local_size, _ in everyone)
        want = "shm" if shared and all(native for _, native in everyone) else "mpi"
    if want == "mpi":
        from keras_dist.transports.mpi import MpiTransport

        return MpiTransport(comm, local_comm, config, rank_names=rank_names)
    if not native_available():
        raise TransportError(
            "KERAS_DIST_CPU_OPERATIONS=shm needs the native extension keras_dist._native, "
            "which failed to import. Reinstall keras_dist, or set KERAS_DIST_CPU_OPERATIONS=mpi."
        )
    if local_comm.Get_size() == comm.Get_size():
        from keras_dist.transports.shm import ShmTransport

        return ShmTransport(comm, config, group_ranks=rank_names)
    from keras_dist.transports.hierarchical import HierarchicalTransport

    return HierarchicalTransport(comm, local_comm, cross_comm, config)


def native_available() -> bool:
    """True when the native extension (and so the shm transport) imports."""
    try:
        from keras_dist import _native  # noqa: F401
        from keras_dist.transports import shm  # noqa: F401
    except ImportError:
        return False
    return True


def gpu_transport(group) -> Transport:
    """The data plane for the group's GPU (cupy) values (``KERAS_DIST_GPU_OPERATIONS``).

    ``nccl``: the NCCL transport (a ``TransportError`` when cupy, its NCCL or
    a GPU is missing: an explicit request is never silently replaced).
    ``mpi``: the values are copied to the host, reduced on the group's CPU
    transport and copied back. ``auto``: ``nccl`` when every rank has cupy with
    NCCL and a GPU, else ``mpi``; ranks agree on it, so none waits in NCCL
    for a rank that reduces on the host. Made on first use (collectively, as
    the first GPU collective is), then kept.

    Args:
        group: the process group (``keras_dist._runtime.context.Group``) of
            size > 1.
    """
    if group.gpu_transport is None:
        want = group.config.gpu_operations
        if want == "auto":
            everywhere = group.comm.allgather(nccl_available())
            want = "nccl" if all(everywhere) else "mpi"
        if want == "nccl":
            from keras_dist.transports.nccl import NcclTransport

            group.gpu_transport = NcclTransport(group.comm, group.local_rank, group.config)
        else:
            from keras_dist.transports.staged import HostStagedTransport

            group.gpu_transport = HostStagedTransport(group.transport)
    return group.gpu_transport


def nccl_available() -> bool:
    """True when cupy imports with NCCL and sees a GPU (what the NCCL transport needs)."""
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError:
        return False
    if not getattr(nccl, "available", True):
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except cupy.cuda.runtime.CUDARuntimeError:
        return False
