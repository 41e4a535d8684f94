"""BroadcastGlobalVariablesCallback: every rank starts from the root's state."""

from __future__ import annotations

import keras

from keras_dist._keras import backends, zero
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
        root_rank: the job rank whose state the others take (a member of
            ``process_set`` when one is given).
        local_variables: a variable or a list of them that keep each rank's
            own value (not broadcast); others may be added later with
            ``register_local_var``.
        process_set: the ranks that take the root's state (default: every
            rank); ranks outside the set keep theirs.

    Example:

    ```python
    model.fit(x, y, callbacks=[kd.callbacks.BroadcastGlobalVariablesCallback(0)])
    ```
    """

    def __init__(self, root_rank: int = 0, local_variables=None, *, process_set=None):
        super().__init__()
        self.root_rank = root_rank
        self.process_set = process_set
        self.broadcast_done = False
        self._local_vars: set[int] = set()
        if local_variables is None:
            local_variables = []
        elif _is_variable(local_variables):
            local_variables = [local_variables]
        local_variables = list(local_variables)
        for index, variable in enumerate(local_variables):
            if not _is_variable(variable):
                raise ValueError(
                    "`local_variables` must be a variable or a list of variables (Keras or "
                    f"TensorFlow). Received: {type(variable).__name__} at position {index}"
                )
            self.register_local_var(variable)

    def register_local_var(self, variable) -> None:
        """Leaves ``variable`` out of the broadcast: each rank keeps its own value."""
        self._local_vars.add(id(variable))

    def on_train_begin(self, logs=None):
        backends.refuse_tf1_graph("BroadcastGlobalVariablesCallback")
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
        variables = [v for v in self.model.weights if id(v) not in self._local_vars]
        optimizer = self.model.optimizer
        if optimizer is not None and optimizer.built:
            variables += zero.replicated_state(optimizer)
        if self.process_set is None or self.process_set.included():
            kd_ops.broadcast_variables(variables, root_rank=self.root_rank,
                                       process_set=self.process_set)
        self.broadcast_done = True


def _is_variable(value) -> bool:
    return callable(getattr(value, "assign", None)) and hasattr(value, "dtype")
