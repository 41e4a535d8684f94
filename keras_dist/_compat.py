"""Every private Keras, TensorFlow and JAX API keras_dist uses, in one place.

A leaf below every layer (the Keras layer and the tensor layer both use it):
it imports no framework until one of its functions is called, so importing
it costs nothing and loads nothing.

Supported: Keras 3.9.0 and later 3.x (``pyproject.toml`` bounds the range;
``tests/unit/test_compat.py`` runs on the newest Keras and, in ``.ci/run``, on
the oldest with TensorFlow 2.16), and the JAX the test extra installs. When a
framework moves one of these, only this module changes.
"""

from __future__ import annotations

import functools
import warnings


def no_automatic_dependency_tracking(method):
    """Decorator: attributes set inside the method are not tracked as Keras state."""
    from keras.src.utils import tracking

    return tracking.no_automatic_dependency_tracking(method)


def print_msg(message: str) -> None:
    """Prints through Keras's own printing (it respects Keras's logging setup)."""
    from keras.src.utils import io_utils

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


def clip_gradients(optimizer, grads) -> list:
    """``grads`` clipped as ``optimizer``'s ``clipnorm``, ``global_clipnorm`` or
    ``clipvalue`` clips them (no None among ``grads``)."""
    return optimizer._clip_gradients(grads)


def uses_weight_decay(optimizer, variable) -> bool:
    """Whether ``optimizer`` decays ``variable`` (not excluded by name or by variable)."""
    return optimizer._use_weight_decay(variable)


def exclude_from_weight_decay(optimizer, variable) -> None:
    """Excludes ``variable`` from ``optimizer``'s weight decay as well, keeping the
    exclusions made so far (``exclude_from_weight_decay`` replaces them)."""
    excluded = set(getattr(optimizer, "_exclude_from_weight_decay", set()))
    optimizer._exclude_from_weight_decay = excluded | {optimizer._var_key(variable)}
    optimizer._exclude_from_weight_decay_cache = {}


def loss_scale_apply(optimizer, grads, trainable_variables) -> None:
    """Runs ``LossScaleOptimizer``'s step on ``optimizer``, a subclass of it.

    The finite check of ``grads``, then either the inner optimizer's update
    and the loss-scale bookkeeping, or a halved loss scale and no update.
    """
    import keras

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
    from keras.src.utils import file_utils

    return file_utils.exists(path)


def in_xla_context() -> bool:
    """True while TensorFlow traces a function that XLA will compile."""
    import keras

    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    if tf.executing_eagerly():
        return False
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


@functools.cache
def _batch_normalization_with_moments() -> type:
    import keras

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

    return BatchNormalizationWithMoments


def __getattr__(name: str):
    # ``BatchNormalizationWithMoments`` subclasses a Keras layer: made when first used.
    if name == "BatchNormalizationWithMoments":
        return _batch_normalization_with_moments()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: Reasons a model's ``jit_compile="auto"`` must resolve to False
#: (``turn_off_auto_jit_compile_when``), and the notices given.
_AUTO_JIT_VETOES: list = []
_NOTICES: set[str] = set()


def _first_frame_outside_frameworks() -> int:
    """The ``stacklevel`` of a warning given by this function's caller that names
    the first frame outside Keras and keras_dist (the user's line)."""
    import os
    import sys

    import keras

    inside = (os.path.dirname(keras.__file__), os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def turn_off_auto_jit_compile_when(veto) -> None:
    """Makes Keras resolve ``jit_compile="auto"`` to False for a model when
    ``veto(model)`` returns a string: a reason (a one-line notice, given once,
    attributed to the user's line that compiled) or ``""`` (no notice).

    Keras resolves "auto" in ``compile()`` (after setting the optimizer) with
    the trainer's private ``_resolve_auto_jit_compile``, which says True for
    TensorFlow whenever it sees a GPU. The method is wrapped once; the
    wrapper asks Keras's own resolution first, and the vetoes only where
    Keras would compile with XLA (so nothing is said where nothing changes).
    """
    from keras.src.trainers.trainer import Trainer

    if veto not in _AUTO_JIT_VETOES:
        _AUTO_JIT_VETOES.append(veto)
    resolve = Trainer._resolve_auto_jit_compile
    if getattr(resolve, "keras_dist_vetoes", False):
        return

    def resolve_with_vetoes(model):
        chosen = resolve(model)
        if not chosen:
            return chosen
        for each in _AUTO_JIT_VETOES:
            reason = each(model)
            if reason is not None:
                if reason and reason not in _NOTICES:
                    _NOTICES.add(reason)
                    warnings.warn(reason, stacklevel=_first_frame_outside_frameworks())
                return False
        return chosen

    resolve_with_vetoes.keras_dist_vetoes = True
    Trainer._resolve_auto_jit_compile = resolve_with_vetoes


# ---------------------------------------------------------------------------
# TensorFlow's and JAX's private APIs, for the tensor layer.


def tape_may_record() -> bool:
    """Whether a TensorFlow gradient tape may record the ops made now."""
    try:
        from tensorflow.python.eager import record
    except ImportError:  # a TensorFlow without it: assume a tape
        return True
    return record.could_possibly_record()


@functools.cache
def func_graph_class() -> type:
    """TensorFlow's class of the graphs ``tf.function`` traces into."""
    from tensorflow.python.framework.func_graph import FuncGraph

    return FuncGraph


def control_flow_context(graph):
    """The control-flow construct (``tf.cond``/``tf.while_loop`` of a TF1 graph)
    that ops built now in ``graph`` land in, or None at the graph's top level.

    Reads ``Graph._get_control_flow_context()``: the tensor layer chains a TF1
    graph's collectives one after another with control edges, which may not
    cross into or out of such a construct.
    """
    return graph._get_control_flow_context()


def jax_trace(value):
    """The JAX trace a traced array belongs to (None for a concrete array).

    Reads the tracer's ``_trace``: the tensor layer orders the calls it traces
    into one function, and two tracers of the same trace are of one function.
    """
    return getattr(value, "_trace", None)


def jax_primitive_parts():
    """``(Primitive, mlir, partial_eval)`` for a JAX primitive of keras_dist's own
    with a lowering and a dead-code rule, or None where this JAX lacks them."""
    try:
        from jax.extend.core import Primitive
        from jax.interpreters import mlir, partial_eval
    except ImportError:
        return None
    if not hasattr(partial_eval, "dce_rules"):
        return None
    return Primitive, mlir, partial_eval


def jax_backends_started() -> bool:
    """Whether JAX has started its backends (its memory settings are read then)."""
    import jax

    started = getattr(getattr(getattr(jax, "_src", None), "xla_bridge", None),
                      "backends_are_initialized", None)
    return bool(started is not None and started())
