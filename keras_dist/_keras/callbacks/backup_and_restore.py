"""BackupAndRestore: Keras' backup callback with one writer and one reader, rank 0.

Keras' own ``keras.callbacks.BackupAndRestore`` gets the same behaviour from
``kd.init()``, which calls ``distribute_keras_class`` (or, where Keras was
not loaded at ``kd.init()``, from this module's import, which the optimizer
wrapper makes): on more than one rank its hooks are this class's, so a plain
``fit`` script restarted by ``kdrun --max-restarts`` resumes on every rank.
With one rank, or before ``kd.init()``, both classes are Keras' callback
exactly.
"""

from __future__ import annotations

import dataclasses

import keras

from keras_dist import _compat as compat
from keras_dist._keras import zero, zero_saving
from keras_dist._runtime import context
from keras_dist.errors import KerasDistError
from keras_dist.tensor import ops as kd_ops

_KerasBackupAndRestore = keras.callbacks.BackupAndRestore

#: Keras' own hooks, kept before ``distribute_keras_class`` replaces them.
_KERAS_HOOKS = {
    name: getattr(_KerasBackupAndRestore, name)
    for name in ("on_train_begin", "on_epoch_end", "on_train_batch_end", "on_train_end")
}


@dataclasses.dataclass(frozen=True)
class _Restored:
    """What rank 0 found when training began; every rank acts on it."""

    weights: bool  # a weights file was loaded
    initial_epoch: int | None  # the epoch fit starts at (Keras' reading of the metadata)
    error: str | None = None  # why rank 0 could not restore


def _distributed() -> bool:
    return context.is_initialized() and context.get().size > 1


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """``keras.callbacks.BackupAndRestore`` for data-parallel training.

    Only rank 0 writes the backup (Keras' weights file and training-metadata
    file, in ``backup_dir``) and deletes it when training ends. When training
    begins, rank 0 alone looks for a backup and restores it as Keras does;
    its decision, the epoch to resume at, and the restored weights and
    optimizer state go to every other rank. So every rank resumes at the
    same epoch with the same state, whether or not the others can see
    ``backup_dir`` (no shared file system is needed), and a backup written
    by N ranks restores on any number of ranks. With one rank it is Keras'
    callback.

    Give it to every rank: each takes part in the restore, and with
    ``save_freq="epoch"`` every rank waits at the end of an epoch until rank
    0's backup is written, so that a rank failing early in the next epoch
    cannot cut the write short. Backups every ``save_freq`` batches are not
    waited for; ``double_checkpoint=True`` keeps the previous backup for a
    write cut short.

    With ``DistributedOptimizer(shard_optimizer_state=True)``, every rank takes
    part in rank 0's write (each rank's share of the optimizer state is
    gathered into the backup, whole) and read (each rank receives its share
    of the backup, at any number of ranks); with ``save_freq`` a number of
    batches, every rank then waits at each batch's end while rank 0 decides.

    A plain ``keras.callbacks.BackupAndRestore`` behaves the same way once
    keras_dist's Keras layer is loaded; this class names it explicitly.

    Args:
        backup_dir: the directory of the backup (on rank 0's file system).
        save_freq: ``"epoch"`` or a number of batches between backups.
        double_checkpoint: also keep the previous backup, restored when the
            latest cannot be read.
        delete_checkpoint: delete the backup when training ends.

    Example:

    ```python
    model.fit(x, y, epochs=10, callbacks=[kd.callbacks.BackupAndRestore("/tmp/backup")])
    ```
    """

    # These hooks are also installed on Keras' class (``distribute_keras_class``),
    # so they call Keras' own hooks directly rather than through ``super()``.

    def on_train_begin(self, logs=None):
        if not _distributed():
            _KERAS_HOOKS["on_train_begin"](self, logs)
            return
        rank_zero = context.get().rank == 0
        failure = restored = None
        sharding = zero_saving.sharding(self.model)
        for optimizer in sharding:  # built, as rank 0's restore builds it, to take its share
            if not optimizer.built:
                optimizer.build(self.model.trainable_variables)
        with zero_saving.served(self.model):
            if rank_zero:
                try:
                    _KERAS_HOOKS["on_train_begin"](self, logs)
                except Exception as error:  # raised below, once every rank knows of it
                    failure = error
                    restored = _Restored(False, None, f"{type(error).__name__}: {error}")
                else:
                    restored = _Restored(
                        weights=compat.file_exists(compat.backup_weights_path(self)),
                        initial_epoch=compat.initial_epoch(self.model))
        restored = kd_ops.broadcast_object(restored, root_rank=0)
        if failure is not None:
            raise failure
        if restored.error is not None:
            raise KerasDistError(
                f"BackupAndRestore: rank 0 could not restore the backup in "
                f"{self.backup_dir!r}: {restored.error}")
        if restored.weights:
            optimizer = self.model.optimizer
            if not rank_zero and optimizer is not None and not optimizer.built:
                optimizer.build(self.model.trainable_variables)  # as Keras' restore does
            variables = list(self.model.weights)
            if optimizer is not None:
                variables += zero.replicated_state(optimizer)
            kd_ops.broadcast_variables(variables, root_rank=0)
        if not rank_zero:
            compat.set_initial_epoch(self.model, restored.initial_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if not _distributed():
            _KERAS_HOOKS["on_epoch_end"](self, epoch, logs)
            return
        # With a sharded optimizer every rank takes part in rank 0's write (zero_saving).
        with zero_saving.served(self.model):
            if context.get().rank == 0:
                _KERAS_HOOKS["on_epoch_end"](self, epoch, logs)
        if self.save_freq == "epoch":
            # No rank runs ahead (and fails, ending the job) while rank 0 writes.
            kd_ops.barrier()

    def on_train_batch_end(self, batch, logs=None):
        if not _distributed():
            _KERAS_HOOKS["on_train_batch_end"](self, batch, logs)
            return
        with zero_saving.served(self.model, when=self.save_freq != "epoch"):
            if context.get().rank == 0:
                _KERAS_HOOKS["on_train_batch_end"](self, batch, logs)

    def on_train_end(self, logs=None):
        if not _distributed():
            _KERAS_HOOKS["on_train_end"](self, logs)
            return
        # The backup goes only once no rank can still fail inside this fit.
        kd_ops.barrier()
        if context.get().rank == 0:
            _KERAS_HOOKS["on_train_end"](self, logs)


def distribute_keras_class() -> None:
    """Gives ``keras.callbacks.BackupAndRestore`` the hooks of ``BackupAndRestore``.

    Every instance, existing or new, then writes and restores through rank 0
    when more than one rank runs; with one rank, or before ``kd.init()``, it
    stays Keras' callback exactly. Calling it again changes nothing.
    """
    for name in _KERAS_HOOKS:
        setattr(_KerasBackupAndRestore, name, BackupAndRestore.__dict__[name])


if context.is_initialized():  # kd.init() ran before Keras was loaded
    distribute_keras_class()
