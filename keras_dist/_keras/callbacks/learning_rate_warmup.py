"""LearningRateWarmupCallback: ramps the learning rate up from initial_lr / size."""

from __future__ import annotations

from keras_dist import _compat as compat
from keras_dist._keras import lr
from keras_dist._keras.callbacks.learning_rate_schedule import LearningRateScheduleCallback
from keras_dist._runtime import context


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Gradual learning-rate warmup (Goyal et al., 2017), batch by batch.

    At batch ``b`` of epoch ``e < warmup_epochs`` the learning rate is
    ``initial_lr / N * (1 + (N - 1) * (e + (b + 1) / S) / warmup_epochs)``,
    with ``N`` ranks and ``S`` batches per epoch, so it reaches ``initial_lr``
    at the last warmup batch; after the warmup it is left at ``initial_lr``.

    Args:
        initial_lr: the learning rate after warmup (usually scaled by size).
        warmup_epochs: epochs the warmup lasts.
        momentum_correction: Horovod's momentum scaling, which has no
            effect in Keras 3 (see `LearningRateScheduleCallback`); an
            explicit ``True`` with a momentum optimizer warns once.
        steps_per_epoch: ``S``; inferred from ``fit`` if ``None``.
        verbose: if > 0, rank 0 prints once when the warmup ends.

    When the optimizer's learning rate is a `LearningRateSchedule`, the
    schedule is multiplied by the warmup factor instead.

    Example:

    ```python
    kd.callbacks.LearningRateWarmupCallback(0.01 * kd.size(), warmup_epochs=3)
    ```
    """

    _batch_offset = 1

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool | None = None, steps_per_epoch: int | None = None,
                 verbose: int = 0):
        if warmup_epochs <= 0:
            raise ValueError(
                f"`warmup_epochs` must be > 0. Received: warmup_epochs={warmup_epochs}"
            )
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

        def multiplier(epoch: float) -> float:
            size = context.get().size
            return 1.0 / size * (1.0 + (size - 1) * epoch / warmup_epochs)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if epoch != self.end_epoch - 1:
            return
        rate = lr.set_learning_rate(self.model.optimizer, self.initial_lr, 1.0)
        if self.verbose and context.get().rank == 0:
            compat.print_msg(
                f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {rate:g}."
            )
