"""The elastic Keras callbacks, with Horovod's names.

Put all three in ``fit``'s callbacks, in any order: each counter update
happens once, whichever callback gets to it first (``progress.Progress``).
"""

from __future__ import annotations

import keras


class _StateCallback(keras.callbacks.Callback):
    def __init__(self, state) -> None:
        super().__init__()
        self.state = state
        self.progress = state.progress

    def on_train_begin(self, logs=None):
        # Called by each elastic callback; the same result every time.
        self.progress.begin_train(self.model, self.params)

    def on_epoch_begin(self, epoch, logs=None):
        self.progress.begin_epoch(epoch)


class CommitStateCallback(_StateCallback):
    """Commits the state every ``batches_per_commit`` batches and at the end
    of every epoch (Horovod's ``hvd.elastic.CommitStateCallback``).

    A commit copies the whole model and optimizer state; with a large model,
    commit every few batches.
    """

    def __init__(self, state, batches_per_commit: int = 1) -> None:
        super().__init__(state)
        if isinstance(batches_per_commit, bool) or not isinstance(batches_per_commit, int) or (
                batches_per_commit < 1):
            raise ValueError("`batches_per_commit` must be a whole number >= 1. "
                             f"Received: batches_per_commit={batches_per_commit!r}")
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch, logs=None):
        self.progress.end_batch(batch)
        self.batches_remaining -= 1
        if self.batches_remaining <= 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.progress.end_epoch(epoch)
        self.state.commit()
        self.batches_remaining = self.batches_per_commit


class UpdateBatchStateCallback(_StateCallback):
    """Keeps ``state.batch`` (batches finished in the epoch) and, after a
    relaunch, ends the epoch being resumed once the steps left are done
    (Horovod's ``hvd.elastic.UpdateBatchStateCallback``)."""

    def __init__(self, state) -> None:
        super().__init__(state)
        self.progress.track_batch = True

    def on_train_batch_end(self, batch, logs=None):
        self.progress.end_batch(batch)

    def on_epoch_end(self, epoch, logs=None):
        self.progress.end_epoch(epoch)


class UpdateEpochStateCallback(_StateCallback):
    """Keeps ``state.epoch`` (epochs finished, across relaunches) (Horovod's
    ``hvd.elastic.UpdateEpochStateCallback``)."""

    def __init__(self, state) -> None:
        super().__init__(state)
        self.progress.track_epoch = True

    def on_epoch_end(self, epoch, logs=None):
        self.progress.end_epoch(epoch)
