"""Learning-rate plumbing for the callbacks: schedules scaled by a factor."""

from __future__ import annotations

import keras

from keras_dist import _compat as compat


def inner_optimizer(optimizer):
    """The optimizer that owns the learning rate (through any wrappers)."""
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer


@keras.saving.register_keras_serializable(package="keras_dist")
class ScaledSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A learning-rate schedule multiplied by a factor the callbacks set.

    The factor is a variable, so a change takes effect in the traced step.
    """

    def __init__(self, schedule, factor: float = 1.0):
        self.schedule = schedule
        self.factor = keras.Variable(factor, dtype="float32", trainable=False,
                                     name="lr_factor")

    def __call__(self, step):
        return _multiply(self.schedule(step), self.factor)

    def get_config(self):
        return {
            "schedule": keras.saving.serialize_keras_object(self.schedule),
            "factor": float(keras.ops.convert_to_numpy(self.factor)),
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["schedule"] = keras.saving.deserialize_keras_object(config["schedule"])
        return cls(**config)


def _multiply(rate, factor):
    rate = keras.ops.convert_to_tensor(rate)
    return rate * keras.ops.cast(factor, rate.dtype)


def set_learning_rate(optimizer, initial_lr: float, multiplier: float) -> float:
    """Sets the learning rate to ``initial_lr * multiplier``; returns the new rate.

    When the optimizer's learning rate is a `LearningRateSchedule`, the
    schedule is multiplied by ``multiplier`` instead (``initial_lr`` is then
    unused) and the schedule's value is returned.
    """
    optimizer = inner_optimizer(optimizer)
    current = compat.learning_rate_attribute(optimizer)
    if isinstance(current, keras.optimizers.schedules.LearningRateSchedule):
        if not isinstance(current, ScaledSchedule):
            current = ScaledSchedule(current)
            compat.set_learning_rate_attribute(optimizer, current)
        current.factor.assign(multiplier)
        return float(keras.ops.convert_to_numpy(current(optimizer.iterations)))
    if callable(current) and not isinstance(current, keras.Variable):
        raise TypeError(
            "The learning-rate callbacks need a float or LearningRateSchedule learning "
            f"rate. Received: a callable {current!r}"
        )
    value = initial_lr * multiplier
    optimizer.learning_rate = value
    return value
