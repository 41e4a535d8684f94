"""BestModelCheckpoint: keeps the best model so far, written by rank 0 only."""

from __future__ import annotations

import keras

from keras_dist._keras import zero_saving
from keras_dist._runtime import context


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Saves the model whenever ``monitor`` improves; only rank 0 writes.

    Horovod's callback of the same name, with Keras 3's requirement that the
    file path be given (Horovod's estimators filled it in). Put it after
    ``MetricAverageCallback``, so that every rank judges "best" on the same
    averaged logs.

    Args:
        filepath: where to save: a ``.keras`` file (or ``.weights.h5`` with
            ``save_weights_only=True``); may hold ``{epoch}`` and log keys.
        monitor: the log entry to watch (default ``"val_loss"``).
        verbose: 1 prints a line on rank 0 when it saves.
        mode: ``"auto"``, ``"min"`` or ``"max"``.
        save_freq: ``"epoch"`` or a number of batches.
        save_weights_only: save only the weights.

    With ``DistributedOptimizer(shard_optimizer_state=True)``, give it to every
    rank: rank 0 decides and writes, and every rank sends its share of the
    optimizer state into the file (``kd.save_model``'s layout); with
    ``save_freq`` a number of batches, the ranks wait at each batch's end
    while rank 0 decides.

    Example:

    ```python
    callbacks = [kd.callbacks.MetricAverageCallback(),
                 kd.callbacks.BestModelCheckpoint(filepath="best.keras", monitor="val_loss")]
    ```
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, mode: str = "auto",
                 save_freq="epoch", *, filepath, save_weights_only: bool = False):
        super().__init__(filepath=filepath, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=save_weights_only,
                         mode=mode, save_freq=save_freq)

    def on_train_batch_end(self, batch, logs=None):
        with zero_saving.served(self.model, when=self.save_freq != "epoch"):
            if context.get().rank == 0:
                super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        with zero_saving.served(self.model):
            if context.get().rank == 0:
                super().on_epoch_end(epoch, logs)
