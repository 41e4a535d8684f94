"""JoinCallback: ``fit`` on data sharded unevenly across ranks."""

from __future__ import annotations

import keras

from keras_dist._keras import zero
from keras_dist._runtime import context
from keras_dist.tensor import ops as kd_ops
from keras_dist.tensor.join import join


class JoinCallback(keras.callbacks.Callback):
    """Lets ranks with fewer batches end each epoch without blocking the others.

    At the end of every epoch this rank calls ``keras_dist.join()``: a rank
    that ran out of batches waits there, taking part in the others' gradient
    allreduces with nothing to add, until every rank has finished the epoch.
    As in Horovod, the averaged gradient still divides by the full number of
    ranks, so the extra batches of the longer ranks count less. A rank that
    waited did not apply those extra steps, so every rank then takes the
    weights and optimizer state of the rank that joined last (which applied
    them all): ranks stay identical. Put it first
    in ``callbacks`` (before ``MetricAverageCallback`` and anything else that
    communicates at the end of an epoch).

    Args:
        process_set: the group to join (default: the whole job).

    Example:

    ```python
    model.fit(dataset_of_this_rank, callbacks=[kd.callbacks.JoinCallback(),
                                               kd.callbacks.MetricAverageCallback()])
    ```
    """

    def __init__(self, process_set=None) -> None:
        super().__init__()
        self.process_set = process_set
        #: The rank that finished the last epoch last (what ``join`` returned).
        self.last_joined_rank: int | None = None

    def on_epoch_end(self, epoch, logs=None):
        if context.group_for(self.process_set).size == 1:
            return
        self.last_joined_rank = last = join(self.process_set)
        variables = list(self.model.weights)
        optimizer = self.model.optimizer
        if optimizer is not None and optimizer.built:
            variables += zero.replicated_state(optimizer)
        extra = {} if self.process_set is None else {"process_set": self.process_set}
        kd_ops.broadcast_variables(variables, root_rank=last, **extra)
