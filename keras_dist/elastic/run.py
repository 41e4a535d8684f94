"""``keras_dist.elastic.run``: the decorator around an elastic training function."""

from __future__ import annotations

import functools
import time

from keras_dist import _lifecycle, ops
from keras_dist._runtime import context, jobstatus
from keras_dist.errors import HostsUpdatedInterrupt


def run(func):
    """Runs ``func(state, ...)`` as elastic training (Horovod's ``hvd.elastic.run``).

    Under ``kdrun`` in elastic mode (``--max-restarts``, ``--min-np``,
    ``--max-np`` or ``--host-discovery-script``) a failure ends every rank
    and kdrun launches the job again; there, this wrapper first brings every
    rank to the newest commit any machine holds (``state.sync()``), then,
    when the launch is not the first, runs the state's reset callbacks, then
    calls ``func``. When kdrun announces new or removed hosts, the next
    commit raises ``HostsUpdatedInterrupt`` on every rank: the wrapper saves
    the current state (nothing is lost) and ends the rank so kdrun can
    relaunch at the new size. When ``func`` returns, this machine's commits
    are removed.

    Without kdrun's elastic mode it syncs the state and calls ``func``.

    ``keras_dist.init()`` is called first if the script has not.
    """

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        started = time.monotonic()
        _lifecycle.init()
        group = context.get()
        state.sync()
        relaunched = group.config.elastic_round > 0
        if relaunched:
            state.on_reset()
        info = dict(state.resumed_from or {}, launch=group.config.elastic_round,
                    size=group.size, seconds=round(time.monotonic() - started, 3),
                    epoch=getattr(state, "epoch", None), batch=getattr(state, "batch", None))
        if group.rank == 0 and group.config.elastic_job is not None:
            jobstatus.record_resumed(info)
        try:
            result = func(state, *args, **kwargs)
        except HostsUpdatedInterrupt:
            if group.config.elastic_job is None:
                raise
            _end_for_resize(state)
        state.discard_commits()  # training is over, after every rank is done
        return result

    return wrapper


def _end_for_resize(state) -> None:
    """Saves the current state as a commit on every machine and ends the rank
    cleanly (``SystemExit(0)``: what follows the training function in the
    script does not run); kdrun relaunches the job on the new hosts."""
    state.save_commit()
    ops.barrier()  # every machine has written before any rank reports
    jobstatus.record_resize()
    _lifecycle.shutdown()
    # A normal exit, not os._exit: MPI must be finalised, or the process
    # manager takes the exit for a crash and kills the other ranks.
    raise SystemExit(0)
