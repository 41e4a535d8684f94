"""The process group: its state, topology, and the hook that ends the job on an
unhandled exception. ``keras_dist._lifecycle`` makes and takes it down."""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
import traceback

from keras_dist._config import Config
from keras_dist._runtime import jobstatus
from keras_dist.errors import NotInitializedError


@dataclasses.dataclass
class Group:
    """Ranks that run collectives together: the job, or one process set.

    ``rank``, ``size`` and the machine layout are the group's own (a process
    set's rank 0 is its lowest job rank); ``ranks`` maps them back to the job.
    """

    config: Config
    comm: object  # mpi4py communicator private to keras_dist
    local_comm: object
    cross_comm: object
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    transport: object  # transports.base.Transport: the CPU data plane
    #: The job rank of each rank of the group, in group order.
    ranks: tuple[int, ...]
    #: 0 for the job, else the id of the process set the group serves.
    process_set_id: int = 0
    gpu_transport: object | None = None  # the NCCL transport, made on first use
    #: On the job's group: the registered process sets by id (0, the job, excluded).
    process_sets: dict[int, RegisteredSet] = dataclasses.field(default_factory=dict)
    #: Whether every machine of the job runs the same number of ranks.
    homogeneous: bool = True
    #: The last collective traced into a JAX function (``tensor.jax_glue.TracedOrder``),
    #: made on first use.
    traced_order: object | None = None

    def close(self) -> None:
        """Closes the group's transports and frees its communicators.

        Collective over the group (freeing an MPI communicator is).
        """
        for transport in (self.gpu_transport, self.transport):
            if transport is not None:
                transport.close()
        self.gpu_transport = None
        for comm in (self.cross_comm, self.local_comm, self.comm):
            comm.Free()


@dataclasses.dataclass(frozen=True)
class RegisteredSet:
    """A process set as the job knows it."""

    #: Its job ranks, ascending.
    ranks: tuple[int, ...]
    #: This rank's group for the set; None where this rank is not a member.
    group: Group | None


_group: Group | None = None
#: Held while the group is made or taken down.
lock = threading.Lock()
_previous_excepthook = None
#: (rank, size) of the job, known from the start of init(), for the excepthook.
_job = (0, 1)


def get() -> Group:
    """The initialised group, or ``NotInitializedError``."""
    group = _group
    if group is None:
        raise NotInitializedError(
            "keras_dist has not been initialised. Call `keras_dist.init()` first."
        )
    return group


def group_for(process_set=None) -> Group:
    """The group a collective runs on: the job's (``process_set`` None or the
    global set), or the group of a ``keras_dist.ProcessSet``.

    Raises:
        NotInitializedError: ``init()`` has not been called.
        ValueError: this rank is not a member of ``process_set``, or the set
            is not registered (raised by the set itself).
    """
    group = get()
    if process_set is None:
        return group
    resolve = getattr(process_set, "_resolve", None)
    if resolve is None:
        raise ValueError("`process_set` must be a keras_dist.ProcessSet. "
                         f"Received: {process_set!r}")
    return resolve(group)


def is_initialized() -> bool:
    return _group is not None


def topology(comm, config: Config) -> dict:
    """Splits ``comm`` (a private duplicate) into the machine and cross communicators.

    Collective over ``comm``. Returns the ``Group`` fields other than
    ``config`` and the transports.
    """
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    machine = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    if config.ranks_per_node:
        local_comm = machine.Split(color=machine.Get_rank() // config.ranks_per_node, key=rank)
        machine.Free()
    else:
        local_comm = machine
    local_rank, local_size = local_comm.Get_rank(), local_comm.Get_size()
    cross_comm = comm.Split(color=local_rank, key=rank)
    homogeneous = len(set(comm.allgather(local_size))) == 1
    return dict(homogeneous=homogeneous,
        comm=comm, local_comm=local_comm, cross_comm=cross_comm, rank=rank, size=size,
        local_rank=local_rank, local_size=local_size, cross_rank=cross_comm.Get_rank(),
        cross_size=cross_comm.Get_size(),
    )


def install(group: Group) -> None:
    """Makes ``group`` the process group, and hands its transport's native
    engine (or None) to the native one-call collectives."""
    global _group
    from keras_dist import _native

    _group = group
    _native.set_dispatch_engine(group.transport.native_engine())


def uninstall() -> Group | None:
    """Forgets the process group and returns it (None when there was none);
    the native one-call collectives stop using its engine first."""
    global _group
    from keras_dist import _native

    _native.set_dispatch_engine(None)
    group, _group = _group, None
    return group


def install_excepthook(rank: int, size: int) -> None:
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
        if issubclass(exc_type, KeyboardInterrupt):
            _previous_excepthook(exc_type, exc, tb)
            return
        if size == 1:
            _previous_excepthook(exc_type, exc, tb)
            jobstatus.record_error(exc)
            return
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        # Under kdrun every line is labelled with its rank already.
        label = "" if jobstatus.supervised() else f"[keras_dist rank {rank}/{size}] "
        sys.stderr.write("".join(label + line + "\n" for line in text.rstrip().splitlines()))
        sys.stderr.flush()
        if not jobstatus.record_error(exc):
            # No supervisor confirmed it forwarded the traceback: give the
            # process manager a moment to, before the abort tears the job's
            # output channels down.
            time.sleep(0.2)
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
        os._exit(1)

    sys.excepthook = abort_job
