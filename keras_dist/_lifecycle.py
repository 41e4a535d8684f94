"""``init()`` and ``shutdown()``: the process group, its transports and the
recording that lasts as long as it does (job status, timeline, output pool)."""

from __future__ import annotations

import atexit
import dataclasses
import sys

from keras_dist import process_sets as sets
from keras_dist import transports
from keras_dist._config import Config
from keras_dist._runtime import context, jobstatus, timeline
from keras_dist.tensor import gpu_memory, outputs


def init(comm=None, process_sets=None) -> None:
    """Initialises keras_dist; a second call does nothing.

    Besides the process group, it changes two things outside keras_dist:
    ``keras.callbacks.BackupAndRestore`` writes and restores through rank 0
    on more than one rank (as ``keras_dist.callbacks.BackupAndRestore``), so a
    plain ``fit`` script restarted by ``kdrun --max-restarts`` resumes in step
    on every rank (where Keras is not loaded yet, keras_dist's optimizer
    wrapper does it when it is first imported); and TensorFlow and JAX are
    told to leave GPU memory to the GPU data plane where the user has not set
    it (``keras_dist.tensor.gpu_memory``).

    Args:
        comm: an mpi4py communicator to run on. Defaults to ``MPI.COMM_WORLD``.
            keras_dist duplicates it, so its messages never mix with the
            caller's.
        process_sets: a list of ``keras_dist.ProcessSet`` to register now (the
            same list on every rank; ids are given in list order from 1), or
            ``"dynamic"`` to allow ``add_process_set`` and
            ``remove_process_set`` later (as ``KERAS_DIST_DYNAMIC_PROCESS_SETS=1``
            or ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` do). None: only the global set.

    Raises:
        ValueError: ``process_sets`` is neither a list of ``ProcessSet`` nor
            ``"dynamic"``, or an entry is a duplicate or names ranks outside
            the job (raised on every rank).
    """
    with context.lock:
        if context.is_initialized():
            return
        config = Config.from_env()
        static, dynamic = sets.parse_init_argument(process_sets)
        if dynamic:
            config = dataclasses.replace(config, dynamic_process_sets=True)
        from mpi4py import MPI

        user_comm = comm
        comm = (MPI.COMM_WORLD if user_comm is None else user_comm).Dup()
        # From here on a failure on one rank (even inside init) ends the job.
        context.install_excepthook(comm.Get_rank(), comm.Get_size())
        fields = context.topology(comm, config)
        transport = transports.cpu_transport(
            config, comm, fields["local_comm"], fields["cross_comm"])
        group = context.Group(config=config, transport=transport,
                              ranks=tuple(range(fields["size"])), **fields)
        try:
            sets.register_at_init(group, static, user_comm)
        except BaseException:
            group.close()
            raise
        context.install(group)
        if "keras" in sys.modules:  # else backup_and_restore does it when imported
            from keras_dist._keras.callbacks import backup_and_restore

            backup_and_restore.distribute_keras_class()
        gpu_memory.leave_gpu_memory()
        jobstatus.record_start(group.rank)
        atexit.register(shutdown)
    if config.timeline_path:
        timeline.start_timeline(config.timeline_path)


def shutdown() -> None:
    """Releases transports and communicators (process sets' too). ``init()`` may
    be called again."""
    with context.lock:
        group = context.uninstall()
        if group is None:
            return
        timeline.stop_timeline()
        outputs.POOL.clear()
        glue = sys.modules.get("keras_dist.tensor.jax_glue")
        if glue is not None:  # its plans name this group's engine
            glue.forget_plans()
        sets.close_all(group)
        group.close()
        jobstatus.record_done(group.rank)
