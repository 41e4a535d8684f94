"""Keras helpers: loading a distributed model, learning-rate plumbing, XLA."""

from __future__ import annotations

import warnings

import keras

from keras_dist import _context
from keras_dist.optimizer import DistributedOptimizer

_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Emits ``message`` as a ``UserWarning`` the first time ``key`` is seen."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def load_model(path, custom_objects=None, compile: bool = True, safe_mode: bool = True):
    """Loads a `.keras` model saved with a `DistributedOptimizer`.

    The optimizer comes back wrapped, with the inner optimizer's state
    (slots, iterations, loss scale, accumulators), so training resumes at any
    number of ranks.

    Args:
        path: the `.keras` file.
        custom_objects: extra classes or functions the model needs.
        compile: as in `keras.saving.load_model`.
        safe_mode: as in `keras.saving.load_model`.

    Returns:
        The model.
    """
    objects = {
        "DistributedOptimizer": DistributedOptimizer,
        "keras_dist>DistributedOptimizer": DistributedOptimizer,
        "keras_dist>ScaledSchedule": ScaledSchedule,
    }
    objects.update(custom_objects or {})
    return keras.saving.load_model(
        path, custom_objects=objects, compile=compile, safe_mode=safe_mode
    )


def disable_xla_for_training(model) -> None:
    """Turns XLA off for ``model``'s train step when collectives run in it.

    ``tf.numpy_function`` (how gradients reach the transport) cannot be
    compiled by XLA. ``fit`` builds the train function before
    ``on_train_begin``, so the callbacks call this there and rebuild it. At
    size 1 no collective runs and XLA stays as the user asked.
    """
    if _context.get().size == 1 or keras.backend.backend() != "tensorflow":
        return
    if getattr(model, "run_eagerly", False) or not getattr(model, "jit_compile", False):
        return
    warn_once(
        "xla",
        "keras_dist: XLA (jit_compile) is turned off for the train step: the gradient "
        "allreduce is a host call that XLA cannot compile.",
    )
    model.jit_compile = False
    model.make_train_function(force=True)


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
    current = optimizer._learning_rate
    if isinstance(current, keras.optimizers.schedules.LearningRateSchedule):
        if not isinstance(current, ScaledSchedule):
            current = ScaledSchedule(current)
            optimizer._learning_rate = current
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
