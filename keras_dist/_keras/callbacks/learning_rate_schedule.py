"""LearningRateScheduleCallback: a multiplier on the learning rate over an epoch range."""

from __future__ import annotations

import math

import keras

from keras_dist._keras import backends, lr, warn_once, xla


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to ``initial_lr * multiplier`` over [start, end).

    Args:
        initial_lr: the base learning rate (usually already scaled by size).
        multiplier: a number, applied as a constant factor over
            [``start_epoch``, ``end_epoch``), or a callable that takes the
            epoch (fractional when ``staircase=False``) and returns the factor.
        start_epoch: first epoch the multiplier applies to.
        end_epoch: first epoch it no longer applies to; ``None`` for no end.
        staircase: update once per epoch (``True``) or every batch, with the
            fractional epoch ``epoch + batch / steps_per_epoch``.
        momentum_correction: Horovod's option to scale the momentum with
            each learning-rate change. It has no effect in Keras 3: the
            optimizers read ``momentum`` as a Python number when the train
            step is traced, so a change made by a callback never reaches the
            step. ``None`` (default, not asked for) and ``False`` say
            nothing; an explicit ``True`` with an optimizer that has a
            momentum warns once that training proceeds without it.
        steps_per_epoch: batches per epoch; inferred from ``fit`` if ``None``
            (needed only when ``staircase=False``).

    When the optimizer's learning rate is a `LearningRateSchedule`, the
    schedule is multiplied by the factor instead and ``initial_lr`` is unused.

    Example:

    ```python
    # Divide the learning rate by 10 from epoch 30 on.
    kd.callbacks.LearningRateScheduleCallback(0.1 * kd.size(), 0.1, start_epoch=30)
    ```
    """

    # Batch b of an epoch counts as epoch + (b + _batch_offset) / steps_per_epoch.
    _batch_offset = 0

    def __init__(self, initial_lr: float, multiplier, start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool | None = None, steps_per_epoch: int | None = None):
        super().__init__()
        if end_epoch is not None and end_epoch < start_epoch:
            raise ValueError(
                "`end_epoch` must be >= `start_epoch`. "
                f"Received: start_epoch={start_epoch}, end_epoch={end_epoch}"
            )
        self.initial_lr = initial_lr
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            factor = float(multiplier)
            self.multiplier = lambda epoch: factor
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0

    def _in_range(self, epoch: float) -> bool:
        end = math.inf if self.end_epoch is None else self.end_epoch
        return self.start_epoch <= epoch < end

    def on_train_begin(self, logs=None):
        backends.refuse_tf1_graph(type(self).__name__)
        xla.disable_xla_for_training(self.model)
        if self.momentum_correction:
            momentum = getattr(lr.inner_optimizer(self.model.optimizer), "momentum", 0)
            if momentum:
                warn_once(
                    "momentum_correction",
                    "keras_dist: momentum_correction has no effect in Keras 3: the optimizer "
                    "reads `momentum` as a Python number when the train step is traced, so "
                    "a per-batch change would never reach the step. Training proceeds "
                    "without it.",
                )
        if not self.staircase and self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
            if not self.steps_per_epoch:
                raise ValueError(
                    f"{type(self).__name__} needs `steps_per_epoch`: fit() does not know "
                    "the number of batches per epoch. Received: steps_per_epoch=None"
                )

    def _set(self, epoch: float) -> float:
        return lr.set_learning_rate(
            self.model.optimizer, self.initial_lr, self.multiplier(epoch)
        )

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch
        if self.staircase and self._in_range(epoch):
            self._set(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if self.staircase or not self._in_range(self.current_epoch):
            return
        self._set(self.current_epoch + (batch + self._batch_offset) / self.steps_per_epoch)
