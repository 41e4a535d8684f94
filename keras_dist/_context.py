"""The process group: initialisation, topology, transport choice, shutdown."""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import threading
import time
import traceback

from keras_dist import _jobstatus
from keras_dist._config import Config
from keras_dist.backends.base import Transport
from keras_dist.errors import NotInitializedError, TransportError


@dataclasses.dataclass
class _Group:
    config: Config
    comm: object  # mpi4py communicator (a private duplicate), or None at size 1
    local_comm: object
    cross_comm: object
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    transport: Transport
    gpu_transport: Transport | None = None


_group: _Group | None = None
_lock = threading.Lock()
_previous_excepthook = None
#: (rank, size) of the job, known from the start of init(), for the excepthook.
_job = (0, 1)


def get() -> _Group:
    """The initialised group, or ``NotInitializedError``."""
    group = _group
    if group is None:
        raise NotInitializedError(
            "keras_dist has not been initialised. Call `keras_dist.init()` first."
        )
    return group


def is_initialized() -> bool:
    return _group is not None


def init(comm=None) -> None:
    """Initialises keras_dist; a second call does nothing.

    Args:
        comm: an mpi4py communicator to run on. Defaults to ``MPI.COMM_WORLD``.
            keras_dist duplicates it, so its messages never mix with the
            caller's.
    """
    global _group
    with _lock:
        if _group is not None:
            return
        config = Config.from_env()
        from mpi4py import MPI

        comm = (MPI.COMM_WORLD if comm is None else comm).Dup()
        rank, size = comm.Get_rank(), comm.Get_size()
        # From here on a failure on one rank (even inside init) ends the job.
        _install_excepthook(rank, size)
        machine = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        if config.ranks_per_node:
            local_comm = machine.Split(color=machine.Get_rank() // config.ranks_per_node, key=rank)
            machine.Free()
        else:
            local_comm = machine
        local_rank, local_size = local_comm.Get_rank(), local_comm.Get_size()
        cross_comm = comm.Split(color=local_rank, key=rank)
        group = _Group(
            config=config,
            comm=comm,
            local_comm=local_comm,
            cross_comm=cross_comm,
            rank=rank,
            size=size,
            local_rank=local_rank,
            local_size=local_size,
            cross_rank=cross_comm.Get_rank(),
            cross_size=cross_comm.Get_size(),
            transport=_cpu_transport(config, comm, local_comm, cross_comm),
        )
        _group = group
        _jobstatus.record_start(rank)
        atexit.register(shutdown)
    from keras_dist import timeline

    if config.timeline_path:
        timeline.start_timeline(config.timeline_path)


def _cpu_transport(config: Config, comm, local_comm, cross_comm) -> Transport:
    if comm.Get_size() == 1:
        from keras_dist.backends.local import LocalTransport

        return LocalTransport()
    want = config.cpu_operations
    if want == "auto":
        want = "shm" if local_comm.Get_size() > 1 and _native_available() else "mpi"
    if want == "mpi":
        from keras_dist.backends.mpi import MpiTransport

        return MpiTransport(comm, local_comm, config)
    if not _native_available():
        raise TransportError(
            "KERAS_DIST_CPU_OPERATIONS=shm needs the native extension keras_dist._native, "
            "which failed to import. Reinstall keras_dist, or set KERAS_DIST_CPU_OPERATIONS=mpi."
        )
    from keras_dist.backends.shm import ShmTransport

    return ShmTransport(local_comm, cross_comm if cross_comm.Get_size() > 1 else None, config)


def _native_available() -> bool:
    try:
        from keras_dist import _native  # noqa: F401
        from keras_dist.backends import shm  # noqa: F401
    except ImportError:
        return False
    return True


def gpu_transport() -> Transport:
    """The NCCL transport, created on first use (it needs a GPU and cupy)."""
    group = get()
    if group.gpu_transport is None:
        from keras_dist.backends.nccl import NcclTransport

        group.gpu_transport = NcclTransport(group.comm, group.local_rank)
    return group.gpu_transport


def shutdown() -> None:
    """Releases transports and communicators. ``init()`` may be called again."""
    global _group
    with _lock:
        group, _group = _group, None
        if group is None:
            return
        from keras_dist import _outputs, timeline

        timeline.stop_timeline()
        _outputs.POOL.clear()
        for transport in (group.gpu_transport, group.transport):
            if transport is not None:
                transport.close()
        for comm in (group.cross_comm, group.local_comm, group.comm):
            comm.Free()
        _jobstatus.record_done(group.rank)


def _install_excepthook(rank: int, size: int) -> None:
    """An unhandled exception on one rank ends the whole job at once.

    Without this, the failing rank would sit in MPI_Finalize (or exit) while
    its peers wait forever in their next collective.
    """
    global _previous_excepthook, _job
    _job = (rank, size)
    if _previous_excepthook is not None:
        return
    _previous_excepthook = sys.excepthook

    def abort_job(exc_type, exc, tb):
        rank, size = _job
        if size == 1 or issubclass(exc_type, KeyboardInterrupt):
            _previous_excepthook(exc_type, exc, tb)
            return
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        label = f"[keras_dist rank {rank}/{size}] "
        sys.stderr.write("".join(label + line + "\n" for line in text.rstrip().splitlines()))
        sys.stderr.flush()
        _jobstatus.record_error(rank, text)
        # Give the process manager a moment to forward the traceback before
        # the abort tears the job's output channels down.
        time.sleep(0.2)
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
        os._exit(1)

    sys.excepthook = abort_job
