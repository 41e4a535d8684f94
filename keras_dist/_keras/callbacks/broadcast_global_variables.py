"""BroadcastGlobalVariablesCallback: every rank starts from the root's state."""

from __future__ import annotations

import keras

from keras_dist._keras.xla import disable_xla_for_training
from keras_dist.tensor import ops as kd_ops


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Gives every rank the root rank's weights and optimizer state.

    All model weights (non-trainable ones too, such as BatchNormalization
    statistics; random-seed states are left alone) and the optimizer's
    variables are overwritten with ``root_rank``'s. When the model is built
    when training begins, the optimizer is built too and the broadcast
    happens before the first gradient step; otherwise right after the first
    batch. Also turns XLA off for the train step when collectives run in it.

    Args:
        root_rank: the rank whose state the others take.

    Example:

    ```python
    model.fit(x, y, callbacks=[kd.callbacks.BroadcastGlobalVariablesCallback(0)])
    ```
    """

    def __init__(self, root_rank: int = 0):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False

    def on_train_begin(self, logs=None):
        disable_xla_for_training(self.model)
        self.broadcast_done = False
        if self.model.built:
            optimizer = self.model.optimizer
            if optimizer is not None and not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            self._broadcast()

    def on_train_batch_begin(self, batch, logs=None):
        if not self.broadcast_done and self.model.built:
            self._broadcast()

    def on_epoch_end(self, epoch, logs=None):
        if not self.broadcast_done:
            self._broadcast()

    def _broadcast(self):
        variables = list(self.model.weights)
        optimizer = self.model.optimizer
        if optimizer is not None and optimizer.built:
            variables += list(optimizer.variables)
        kd_ops.broadcast_variables(variables, root_rank=self.root_rank)
        self.broadcast_done = True
