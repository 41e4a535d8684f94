"""Every private Keras and TensorFlow API keras_dist uses, in one place.

Supported: Keras 3.9.0 and later 3.x (``pyproject.toml`` bounds the range;
``tests/unit/test_compat.py`` runs on the newest Keras and, in ``.ci/run``, on
the oldest with TensorFlow 2.16). When Keras moves one of these, only this
module changes.
"""

from __future__ import annotations

import keras
from keras.src.utils import file_utils, io_utils, tracking

#: Decorator: attributes set inside the method are not tracked as Keras state.
no_automatic_dependency_tracking = tracking.no_automatic_dependency_tracking


def print_msg(message: str) -> None:
    """Prints through Keras's own printing (it respects Keras's logging setup)."""
    io_utils.print_msg(message)


def learning_rate_attribute(optimizer):
    """The optimizer's stored learning rate: a variable, a schedule or a callable."""
    return optimizer._learning_rate


def set_learning_rate_attribute(optimizer, value) -> None:
    """Replaces the optimizer's stored learning rate (e.g. by a wrapping schedule)."""
    optimizer._learning_rate = value


def built_variables(optimizer) -> list:
    """The trainable variables ``optimizer`` was built with, in build order."""
    return optimizer._trainable_variables


def variable_index(optimizer, variable) -> int:
    """The position of ``variable`` among ``built_variables(optimizer)``."""
    return optimizer._get_variable_index(variable)


def loss_scale_apply(optimizer, grads, trainable_variables) -> None:
    """Runs ``LossScaleOptimizer``'s step on ``optimizer``, a subclass of it.

    The finite check of ``grads``, then either the inner optimizer's update
    and the loss-scale bookkeeping, or a halved loss scale and no update.
    """
    keras.optimizers.LossScaleOptimizer._common_apply(
        optimizer, grads, trainable_variables=trainable_variables
    )


def initial_epoch(model):
    """The epoch ``fit`` starts at when set by a callback (``BackupAndRestore``), or None.

    ``fit`` reads it after ``on_train_begin`` and prefers it to its own
    ``initial_epoch`` argument.
    """
    return model._initial_epoch


def set_initial_epoch(model, epoch) -> None:
    """Makes ``fit`` start at ``epoch`` (None: at its ``initial_epoch`` argument)."""
    model._initial_epoch = epoch


def backup_weights_path(callback) -> str:
    """The weights file a ``keras.callbacks.BackupAndRestore`` saves and restores."""
    return callback._weights_path


def file_exists(path) -> bool:
    """Whether ``path`` exists, as Keras' own file handling sees it (remote paths too)."""
    return file_utils.exists(path)


def in_xla_context() -> bool:
    """True while TensorFlow traces a function that XLA will compile."""
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    if tf.executing_eagerly():
        return False
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


class BatchNormalizationWithMoments(keras.layers.BatchNormalization):
    """``BatchNormalization`` whose batch statistics come from ``batch_moments``.

    Keras computes them in the private ``_moments(inputs, mask)``; a subclass
    overrides ``batch_moments`` instead, with the same arguments and results
    (mean and variance over the reduction axes).
    """

    def _moments(self, inputs, mask):
        return self.batch_moments(inputs, mask)

    def batch_moments(self, inputs, mask):
        return super()._moments(inputs, mask)

    def reduction_axes(self) -> list[int]:
        """The axes the statistics are taken over (all but the feature axes)."""
        return list(self._reduction_axes)


#: Reasons a model's ``jit_compile="auto"`` must resolve to False
#: (``turn_off_auto_jit_compile_when``).
_AUTO_JIT_VETOES: list = []


def turn_off_auto_jit_compile_when(veto) -> None:
    """Makes Keras resolve ``jit_compile="auto"`` to False for a model when
    ``veto(model)`` returns a reason (a one-line notice, printed once).

    Keras resolves "auto" in ``compile()`` (after setting the optimizer) with
    the trainer's private ``_resolve_auto_jit_compile``, which says True for
    TensorFlow whenever it sees a GPU. The method is wrapped once; the
    wrapper asks each veto, then Keras's own resolution.
    """
    from keras.src.trainers.trainer import Trainer

    if veto not in _AUTO_JIT_VETOES:
        _AUTO_JIT_VETOES.append(veto)
    resolve = Trainer._resolve_auto_jit_compile
    if getattr(resolve, "keras_dist_vetoes", False):
        return

    def resolve_with_vetoes(model):
        for each in _AUTO_JIT_VETOES:
            reason = each(model)
            if reason:
                from keras_dist._keras import warn_once

                warn_once("auto-jit", reason)
                return False
        return resolve(model)

    resolve_with_vetoes.keras_dist_vetoes = True
    Trainer._resolve_auto_jit_compile = resolve_with_vetoes
