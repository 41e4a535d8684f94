"""MetricAverageCallback: epoch logs become their mean over ranks."""

from __future__ import annotations

import numbers

import keras
import numpy as np

from keras_dist import _vocab
from keras_dist._keras import backends
from keras_dist._keras.xla import disable_xla_for_training
from keras_dist._runtime import context
from keras_dist.tensor import ops as kd_ops


class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces every numeric epoch log entry by its mean over all ranks.

    Entries (``val_*`` included) are averaged in sorted key order in one
    allreduce, in place, so the callbacks after this one (the progress bar,
    `History`, `ModelCheckpoint`, ...) see the averages. Put it before any
    callback that reads the logs.

    Args:
        process_set: the ranks to average over (default: every rank); ranks
            outside the set keep their own logs.

    Example:

    ```python
    model.fit(x, y, callbacks=[kd.callbacks.MetricAverageCallback()])
    ```
    """

    def __init__(self, *, process_set=None):
        super().__init__()
        self.process_set = process_set

    def on_train_begin(self, logs=None):
        backends.refuse_tf1_graph("MetricAverageCallback")
        disable_xla_for_training(self.model)

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or context.get().size == 1:
            return
        if self.process_set is not None and not self.process_set.included():
            return
        keys = sorted(key for key, value in logs.items() if _is_number(value))
        values = np.array([float(logs[key]) for key in keys], dtype=np.float64)
        averaged = kd_ops.allreduce(values, op=_vocab.Average, name="metric_average",
                                    process_set=self.process_set)
        for key, value in zip(keys, averaged):
            logs[key] = float(value)


def _is_number(value) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (numbers.Real, np.number)):
        return True
    return isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "fiu"
