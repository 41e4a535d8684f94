"""``init()`` and ``shutdown()``: the process group, its transports and the
recording that lasts as long as it does (job status, timeline, output pool)."""

from __future__ import annotations

import atexit

from keras_dist import transports
from keras_dist._config import Config
from keras_dist._runtime import context, jobstatus, timeline
from keras_dist.tensor import outputs


def init(comm=None) -> None:
    """Initialises keras_dist; a second call does nothing.

    Args:
        comm: an mpi4py communicator to run on. Defaults to ``MPI.COMM_WORLD``.
            keras_dist duplicates it, so its messages never mix with the
            caller's.
    """
    with context.lock:
        if context.is_initialized():
            return
        config = Config.from_env()
        from mpi4py import MPI

        comm = (MPI.COMM_WORLD if comm is None else comm).Dup()
        # From here on a failure on one rank (even inside init) ends the job.
        context.install_excepthook(comm.Get_rank(), comm.Get_size())
        fields = context.topology(comm, config)
        transport = transports.cpu_transport(
            config, comm, fields["local_comm"], fields["cross_comm"])
        group = context.Group(config=config, transport=transport, **fields)
        context.install(group)
        jobstatus.record_start(group.rank)
        atexit.register(shutdown)
    if config.timeline_path:
        timeline.start_timeline(config.timeline_path)


def shutdown() -> None:
    """Releases transports and communicators. ``init()`` may be called again."""
    with context.lock:
        group = context.uninstall()
        if group is None:
            return
        timeline.stop_timeline()
        outputs.POOL.clear()
        for transport in (group.gpu_transport, group.transport):
            if transport is not None:
                transport.close()
        for comm in (group.cross_comm, group.local_comm, group.comm):
            comm.Free()
        jobstatus.record_done(group.rank)
