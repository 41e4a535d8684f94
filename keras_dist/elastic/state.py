"""Elastic state: what a job commits, and brings back after kdrun relaunches it.

``state.commit()`` keeps a copy of the state in memory (``state.restore()``
goes back to it) and, under ``kdrun`` in elastic mode, writes it to this
machine's store (``keras_dist.elastic.store``) before asking whether hosts
changed. ``state.sync()`` (run by ``keras_dist.elastic.run`` when training
starts) brings every rank to the newest commit that any machine holds, or,
in a job that never committed, to rank 0's state.

Every rank must commit at the same points (every rank runs the same steps in
data-parallel training), so the commit numbers agree across ranks.
"""

from __future__ import annotations

import copy
import time

import numpy as np

from keras_dist import ops
from keras_dist._runtime import context, jobstatus
from keras_dist.elastic.progress import Progress
from keras_dist.elastic.store import Store
from keras_dist.errors import HostsUpdatedInterrupt


class State:
    """State that every rank holds the same copy of (Horovod's ``hvd.elastic.State``).

    Subclasses say what the state is through ``_capture`` and ``_apply``.
    """

    def __init__(self) -> None:
        self._reset_callbacks: list = []
        #: Number of the last commit (0: none yet).
        self._commit_number = 0
        self._host_version = 0
        self._saved: tuple[list[np.ndarray], dict] | None = None
        #: What the callbacks track of the epoch (see ``progress.Progress``).
        self._progress = Progress(self)
        #: Set by ``sync``: where the state came from, for the reports.
        self.resumed_from: dict | None = None

    # --- Horovod's API ---------------------------------------------------------

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions run (without arguments) after the job is relaunched at a
        new size or after a failure, once the state is restored and before
        training goes on; e.g. to scale the learning rate to ``size()``."""
        callbacks = list(callbacks)
        for callback in callbacks:
            if not callable(callback):
                raise TypeError(f"Reset callbacks must be callable. Received: {callback!r}")
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Runs ``reset()`` and then the reset callbacks."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def reset(self) -> None:
        """Subclasses' hook, run before the reset callbacks."""

    def save(self) -> None:
        """Keeps a copy of the current state in memory (``restore`` returns to it)."""
        arrays, objects = self._capture()
        self._saved = ([np.array(a, copy=True) for a in arrays], copy.deepcopy(objects))

    def restore(self) -> None:
        """Returns to the last commit (or the state at sync), undoing what came after."""
        if self._saved is None:
            self.save()
            return
        arrays, objects = self._saved
        self._apply(arrays, copy.deepcopy(objects))

    def commit(self) -> None:
        """Saves the state (in memory and, in an elastic job, on this machine)
        and checks whether hosts changed (see ``check_host_updates``).

        A commit copies the whole state: commit every few batches, not every
        one, when the model is large.
        """
        self.save_commit()
        self.check_host_updates()

    def save_commit(self) -> None:
        """Saves the state as the next commit (in memory and, in an elastic
        job, on this machine): ``commit`` without the check for new hosts."""
        self.save()
        self._commit_number += 1
        self._write_commit()

    def discard_commits(self) -> None:
        """Training is over: this machine's commits go, once every rank is done
        (a collective in an elastic job; nothing to do outside one)."""
        store = self._store()
        if store is None:
            return
        ops.barrier()
        if context.get().local_rank == 0:
            store.remove_job()

    @property
    def commit_number(self) -> int:
        """The number of the last commit (0: none yet)."""
        return self._commit_number

    @property
    def progress(self) -> Progress:
        """What the elastic callbacks and data track of the epoch (``progress.Progress``)."""
        return self._progress

    def check_host_updates(self) -> None:
        """Raises ``HostsUpdatedInterrupt`` on every rank when kdrun has
        announced a change of hosts since the last check (a collective: call
        it on every rank at the same point)."""
        group = context.get()
        if group.config.elastic_job is None:
            return
        newest = jobstatus.host_update_version() if group.rank == 0 else 0
        newest = ops.broadcast_object(newest, root_rank=0)
        if newest > self._host_version:
            self._host_version = newest
            raise HostsUpdatedInterrupt(f"kdrun announced a change of hosts (notice {newest})")

    def sync(self) -> None:
        """Brings every rank to the newest commit any machine holds (after a
        relaunch), else to rank 0's state; a collective."""
        started = time.monotonic()
        group = context.get()
        store = self._store()
        held = store.newest() if store is not None else -1
        gathered = ops.allgather_object((held, group.rank))
        best = max(number for number, _ in gathered)
        if best >= 0:
            root = min(rank for number, rank in gathered if number == best)
            arrays, meta = store.read(best) if group.rank == root else self._capture_meta()
            meta = ops.broadcast_object(meta if group.rank == root else None, root_rank=root)
            arrays = self._broadcast_arrays(arrays, root)
            self._apply(arrays, meta["objects"])
            self._commit_number = meta["commit"]
            self._progress.restore(meta["progress"], meta["size"])
            self.resumed_from = {"commit": best, "rank": root, "size": meta["size"]}
        else:
            arrays, objects = self._capture()
            objects = ops.broadcast_object(objects, root_rank=0)
            self._apply(self._broadcast_arrays(arrays, 0), objects)
            self.resumed_from = None
        self.save()
        if store is not None and best >= 0 and held < best:
            self._write_commit()  # this machine holds the newest commit from now on
        if self.resumed_from is not None:
            self.resumed_from["seconds"] = time.monotonic() - started

    # --- subclass hooks --------------------------------------------------------

    def _capture(self) -> tuple[list, dict]:
        """(arrays, picklable objects) of the current state."""
        raise NotImplementedError

    def _apply(self, arrays: list, objects: dict) -> None:
        """Makes (arrays, objects) the current state."""
        raise NotImplementedError

    def _broadcast_arrays(self, arrays: list, root: int) -> list:
        return [ops.broadcast(np.asarray(a), root_rank=root) for a in arrays]

    # --- the store -------------------------------------------------------------

    def _store(self) -> Store | None:
        config = context.get().config
        if config.elastic_job is None:
            return None
        return Store(config.elastic_job, config.elastic_dir)

    def _capture_meta(self) -> tuple[list, None]:
        return self._capture()[0], None

    def _write_commit(self) -> None:
        group = context.get()
        store = self._store()
        if store is None or group.local_rank != 0 or self._saved is None:
            return
        arrays, objects = self._saved
        store.write(self._commit_number, arrays, {
            "commit": self._commit_number, "objects": objects,
            "progress": self._progress.snapshot(), "size": group.size,
        })


class ObjectState(State):
    """Python values every rank holds the same copy of (Horovod's ``ObjectState``).

    Each keyword argument becomes an attribute (``state.epoch``...); its
    value must be picklable.
    """

    def __init__(self, **kwargs) -> None:
        self._object_names = tuple(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        super().__init__()

    def _capture(self) -> tuple[list, dict]:
        return [], {name: getattr(self, name) for name in self._object_names}

    def _apply(self, arrays: list, objects: dict) -> None:
        for name, value in objects.items():
            setattr(self, name, value)
