"""Transports: one class per module, all implementing ``base.Transport``.

This package also chooses the transport for a process group
(``cpu_transport``, ``gpu_transport``): the settings say which data plane,
the topology says which can serve.
"""

from __future__ import annotations

import socket
import warnings
from collections.abc import Sequence

import numpy as np

from keras_dist._config import Config
from keras_dist.errors import TransportError
from keras_dist.transports.base import Transport


def cpu_transport(config: Config, comm, local_comm, cross_comm, *,
                  rank_names: Sequence[int] | None = None) -> Transport:
    """The CPU data plane for a group (``KERAS_DIST_CPU_OPERATIONS``), able to ``join``.

    ``shm``: the shm transport when the group runs on one machine, the
    hierarchical one (shm inside each machine, MPI among them) when it spans
    several. ``mpi``: the MPI transport. ``auto``: ``shm`` when some machine
    runs more than one rank, else ``mpi``. Collective over ``comm``: every rank
    makes the same choice.

    Args:
        config: the settings.
        comm: the group's communicator (its ranks are the transport's).
        local_comm: the ranks on this machine.
        cross_comm: the ranks with this rank's local rank, one per machine.
        rank_names: what messages call each rank of ``comm`` (its job rank,
            for a process set); defaults to its rank in ``comm``. The shm and
            MPI transports use them.
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
        want = "shm" if any(size > 1 for size in comm.allgather(local_comm.Get_size())) else "mpi"
    if want == "mpi":
        from keras_dist.transports.mpi import MpiTransport

        return MpiTransport(comm, local_comm, config, rank_names=rank_names)
    if local_comm.Get_size() == comm.Get_size():
        from keras_dist.transports.shm import ShmTransport

        return ShmTransport(comm, config, group_ranks=rank_names)
    from keras_dist.transports.hierarchical import HierarchicalTransport

    return HierarchicalTransport(comm, local_comm, cross_comm, config)


def gpu_transport(group, device_id: int = 0) -> Transport:
    """The data plane for the group's GPU (cupy) values (``KERAS_DIST_GPU_OPERATIONS``).

    ``nccl``: the NCCL transport on GPU ``device_id`` (the GPU of the values
    of the first GPU collective). ``mpi``: the values are copied to the host,
    reduced on the group's CPU transport and copied back. ``auto``: ``nccl``
    when every rank has cupy with NCCL and a GPU no other rank of the group
    uses (NCCL refuses two ranks on one GPU), else ``mpi``, with a notice when
    ranks share a GPU. Made on first use, collectively (ranks agree over the
    CPU transport, so a rank that has called ``join`` makes the others raise
    rather than wait), then kept.

    Args:
        group: the process group (``keras_dist._runtime.context.Group``).
        device_id: this rank's GPU.

    Raises:
        TransportError: ``nccl`` was asked for and cannot serve: cupy, its NCCL
            or a GPU is missing on some rank, or ranks share a GPU (raised on
            every rank, saying which; never silently replaced).
    """
    if group.gpu_transport is None:
        group.gpu_transport = _choose_gpu_transport(group, device_id)
    return group.gpu_transport


def _choose_gpu_transport(group, device_id: int) -> Transport:
    from keras_dist.transports import nccl
    from keras_dist.transports.staged import HostStagedTransport

    want = group.config.gpu_operations
    if want == "mpi":
        return HostStagedTransport(group.transport)
    reason = nccl.unavailable_reason()
    where = (socket.gethostname(), nccl.gpu_identity(device_id)) if reason is None else None
    places = _gather_gpu_places(group, where)
    unable = [group.ranks[r] for r, place in enumerate(places) if place is None]
    shared = _sharing(places, group.ranks)
    if want == "nccl":
        if reason is not None:
            raise TransportError(f"KERAS_DIST_GPU_OPERATIONS=nccl on rank "
                                 f"{group.ranks[group.rank]}: {reason}")
        if unable:
            raise TransportError(
                f"KERAS_DIST_GPU_OPERATIONS=nccl: ranks {unable} cannot use NCCL (each says "
                "why). Set KERAS_DIST_GPU_OPERATIONS=auto or mpi to stage GPU values through "
                "host memory")
        if shared:
            raise TransportError(
                f"KERAS_DIST_GPU_OPERATIONS=nccl: {_describe_sharing(shared)}, and NCCL refuses "
                "two ranks on one GPU. Give each rank a GPU of its own (kdrun --gpu-per-rank, "
                "or pin by local rank), or set KERAS_DIST_GPU_OPERATIONS=mpi to stage GPU "
                "values through host memory")
    elif unable or shared:
        if shared and group.rank == 0:
            warnings.warn(f"keras_dist: {_describe_sharing(shared)}; NCCL refuses two ranks on "
                          "one GPU, so GPU values are staged through host memory. Give each "
                          "rank a GPU of its own (kdrun --gpu-per-rank) for NCCL.",
                          RuntimeWarning, stacklevel=4)
        return HostStagedTransport(group.transport)
    return nccl.NcclTransport(group.comm, device_id, group.config, rank_names=group.ranks)


#: Bytes of a rank's record in the GPU agreement (``place_record``).
_PLACE_BYTES = 512


def place_record(where: tuple[str, str] | None) -> np.ndarray:
    """A rank's record in the GPU agreement: a length word, then the host and
    GPU names (UTF-8, NUL between them); nothing after the word: no NCCL."""
    text = b"" if where is None else "\0".join(where).encode()[: _PLACE_BYTES - 8]
    record = np.zeros(_PLACE_BYTES, np.uint8)
    record[:8] = np.frombuffer(np.int64(8 + len(text)).tobytes(), np.uint8)
    record[8 : 8 + len(text)] = np.frombuffer(text, np.uint8)
    return record


def _gather_gpu_places(group, where: tuple[str, str] | None) -> list:
    """Every rank's ``(host, GPU)``, or None where NCCL cannot serve, in group
    order, gathered over the group's CPU transport."""
    recv = np.zeros(_PLACE_BYTES * group.size, np.uint8)
    group.transport.allgather_records(place_record(where), recv,
                                      name="keras_dist GPU data plane agreement")
    places = []
    for rank in range(group.size):
        record = recv[rank * _PLACE_BYTES : (rank + 1) * _PLACE_BYTES]
        body = record[8 : int(record[:8].view(np.int64)[0])].tobytes().decode()
        places.append(tuple(body.split("\0")) if body else None)
    return places


def _sharing(places: list, ranks: Sequence[int]) -> list[tuple[tuple[str, str], list[int]]]:
    """``((host, GPU), job ranks)`` for each GPU that several ranks use."""
    users: dict[tuple[str, str], list[int]] = {}
    for rank, place in enumerate(places):
        if place is not None:
            users.setdefault(place, []).append(ranks[rank])
    return [(place, members) for place, members in users.items() if len(members) > 1]


def _describe_sharing(shared: list) -> str:
    return "; ".join(f"ranks {members} share GPU {gpu} on {host}"
                     for (host, gpu), members in shared)


def nccl_available() -> bool:
    """True when cupy imports with NCCL and sees a GPU (what the NCCL transport needs)."""
    from keras_dist.transports import nccl

    return nccl.unavailable_reason() is None
