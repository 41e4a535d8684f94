"""``init()`` and ``shutdown()``: the process group, its transports and the
recording that lasts as long as it does (job status, timeline, output pool)."""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys

from keras_dist import process_sets as sets
from keras_dist import transports
from keras_dist._config import Config
from keras_dist._runtime import context, jobstatus, placement, timeline
from keras_dist._runtime import rendezvous as rendezvous_module
from keras_dist.errors import RendezvousError
from keras_dist.tensor import gpu_memory, outputs


def init(comm=None, process_sets=None, *, rendezvous: str | None = None,
         rank: int | None = None, size: int | None = None,
         local_rank: int | None = None) -> None:
    """Initialises keras_dist; a second call does nothing.

    Under ``kdrun`` or ``mpiexec`` the job is MPI's. Processes that a cluster
    started themselves (torchrun's ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``; Kubeflow Trainer's ``PET_*``; or the ``rendezvous``
    arguments) meet at rank 0's address and form the same job, with no
    mpiexec and no ssh: call ``init()`` before anything imports
    ``mpi4py.MPI``.

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
        rendezvous: ``"host:port"`` where rank 0 listens and the others
            connect, for processes no MPI launcher started. Needs ``rank``
            and ``size``. Default: the cluster's variables, if any.
        rank: this process's rank, in [0, size), with ``rendezvous``.
        size: the number of processes of the job, with ``rendezvous``.
        local_rank: this process's rank on its machine, if known; checked
            against the one MPI finds.

    Raises:
        ValueError: ``process_sets`` is neither a list of ``ProcessSet`` nor
            ``"dynamic"``, or an entry is a duplicate or names ranks outside
            the job (raised on every rank); the rendezvous arguments or the
            cluster's variables are incomplete or out of range.
        RendezvousError: processes that started themselves could not form
            their job within ``KERAS_DIST_RENDEZVOUS_TIMEOUT`` seconds; the
            message names what was waited for.
    """
    with context.lock:
        if context.is_initialized():
            return
        config = Config.from_env()
        for name in rendezvous_module.SECRET_VARIABLES:  # not for processes this one starts
            os.environ.pop(name, None)
        static, dynamic = sets.parse_init_argument(process_sets)
        if dynamic:
            config = dataclasses.replace(config, dynamic_process_sets=True)
        place = _placement(comm, rendezvous, rank, size, local_rank, config)
        from mpi4py import MPI

        if place is not None:
            rendezvous_module.mpi_started()
            rendezvous_module.check_world(place, MPI.COMM_WORLD.Get_size(),
                                          MPI.Get_library_version())

        user_comm = comm
        comm = (MPI.COMM_WORLD if user_comm is None else user_comm).Dup()
        # From here on a failure on one rank (even inside init) ends the job.
        context.install_excepthook(comm.Get_rank(), comm.Get_size())
        fields = context.topology(comm, config)
        rendezvous_module.check_local_rank(place, fields["local_rank"])
        if place is not None:
            rendezvous_module.release_mpi_segments(fields["local_rank"])
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


def _placement(comm, address, rank, size, local_rank,
               config: Config) -> placement.Placement | None:
    """This process's place in a job it started itself into, once met with
    the others; None when MPI's launcher placed it (or it runs alone)."""
    if address is not None:
        if comm is not None:
            raise ValueError("`init()` takes `comm` or `rendezvous`, not both. Received: "
                             f"comm={comm!r}, rendezvous={address!r}")
        place = placement.from_arguments(address, rank, size, local_rank)
    elif rank is not None or size is not None or local_rank is not None:
        raise ValueError("`rank`, `size` and `local_rank` go with `rendezvous`. Received: "
                         f"rank={rank!r}, size={size!r}, local_rank={local_rank!r}")
    elif comm is not None:
        return None
    else:
        place = placement.from_environment(os.environ)
    if place is None or place.size == 1:
        return None  # alone: MPI starts as a singleton, no one to meet
    started = sys.modules.get("mpi4py.MPI")
    if started is not None and started.Is_initialized():
        world = started.COMM_WORLD.Get_size()
        if world == place.size:
            return place  # MPI formed this job already (an init after shutdown, or joined first)
        raise RendezvousError(
            f"{place.source} place this process as rank {place.rank} of {place.size}, but MPI "
            f"was started in it before kd.init() (a job of {world}): call kd.init() before "
            "anything imports mpi4py.MPI.")
    rendezvous_module.join(place, config.rendezvous_timeout_seconds, config.rendezvous_secret,
                           config.rendezvous_served_by_launcher)
    return place


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
