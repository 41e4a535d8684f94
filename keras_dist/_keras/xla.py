"""XLA and the train step: collectives are host calls that XLA cannot compile."""

from __future__ import annotations

import keras

from keras_dist._keras import warn_once
from keras_dist._runtime import context


def disable_xla_for_training(model) -> None:
    """Turns XLA off for ``model``'s train step when collectives run in it.

    ``tf.numpy_function`` (how gradients reach the transport) cannot be
    compiled by XLA. ``fit`` builds the train function before
    ``on_train_begin``, so the callbacks call this there and rebuild it. At
    size 1 no collective runs and XLA stays as the user asked.
    """
    if context.get().size == 1 or keras.backend.backend() != "tensorflow":
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
