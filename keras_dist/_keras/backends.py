"""Per-backend glue of the Keras layer: what differs between TensorFlow, JAX and PyTorch.

- TensorFlow: in a traced step the gradients' grouped allreduce is keras_dist's
  own op, ``KerasDistAllreduce`` (``keras_dist.tensor.tf.kernel``), on the shm
  engine with no scaling; otherwise (another transport, a scaled call,
  ``KERAS_DIST_TF_OP=0``) a ``tf.numpy_function`` op. XLA compiles neither
  (see ``xla.py``).
- JAX: Keras jits a stateless step; on the CPU an unscaled allreduce inside it
  is a call of keras_dist's XLA FFI handler (``jax_glue.native_allreduce``),
  any other collective a ``jax.experimental.buffer_callback``, chained so every
  rank runs them in the same order (``keras_dist.tensor.jax_glue``);
  ``jit_compile`` stays as the user set it. Variables cannot be assigned
  inside a branch of a traced ``cond``, so loss scaling goes through Keras's
  own stateless loss-scale step, and with ``backward_passes_per_step`` > 1
  the wrapped optimizer applies on every step and the old values are kept
  where a step does not communicate (as Keras's own gradient accumulation
  does on JAX); loss scaling together with accumulation is not supported
  there (it raises at the first step).
- PyTorch: Keras's trainer is eager; with ``jit_compile=True`` (``torch.compile``)
  the reduction runs outside the compiled graph (``torch.compiler.disable``).

With ``shard_optimizer_state`` (``zero.py``) every backend takes one route:
no assignment inside a branch, the weights exchanged by an allreduce.
"""

from __future__ import annotations

from collections.abc import Callable

import keras


def name() -> str:
    return keras.backend.backend()


def check_supported() -> None:
    """Raises, in one sentence, for a combination this backend does not support."""
    backend = name()
    if backend not in ("tensorflow", "jax", "torch"):
        raise NotImplementedError(
            f"DistributedOptimizer supports the tensorflow, jax and torch Keras backends; "
            f"set KERAS_BACKEND to one of them. Received: backend={backend!r}")
    distribution = keras.distribution.distribution()
    if distribution is not None:
        raise RuntimeError(
            "DistributedOptimizer cannot run under a keras.distribution setting, which "
            "distributes the model its own way; unset it (keras.distribution."
            "set_distribution(None)) to train with keras_dist. Received: "
            f"{type(distribution).__name__}")
    if backend == "tensorflow":
        import tensorflow as tf

        if tf.distribute.has_strategy():
            raise RuntimeError(
                "DistributedOptimizer cannot run inside a tf.distribute strategy scope, "
                "which would reduce gradients a second time; build and compile the model "
                "outside the scope. Received: "
                f"{type(tf.distribute.get_strategy()).__name__}")


def refuse_tf1_graph(what: str) -> None:
    """Raises, in one sentence, where TensorFlow builds TF1 graphs
    (``tf.compat.v1.disable_eager_execution()`` or ``disable_v2_behavior()``):
    Keras 3 does not train there, and would fail deep inside its trainer.

    Args:
        what: what refuses, for the message (``"DistributedOptimizer(Adam)"``).
    """
    if name() != "tensorflow":
        return
    import tensorflow as tf

    if not tf.compat.v1.executing_eagerly_outside_functions():
        raise ValueError(
            f"{what} needs TensorFlow to run eagerly (Keras 3 does not train a model in TF1 "
            "graph mode): leave eager execution on, or write the TF1 graph with a "
            "tf.compat.v1.train optimizer in kd.DistributedOptimizer and "
            "kd.BroadcastGlobalVariablesHook. Received: a TF1 graph "
            "(tf.compat.v1.disable_eager_execution() or disable_v2_behavior())")


def host_function(function: Callable) -> Callable:
    """``function`` made to run eagerly even inside ``torch.compile`` (torch); as is otherwise."""
    if name() != "torch":
        return function
    import torch

    return torch.compiler.disable(function)


def fresh(value):
    """``value`` in a buffer of its own (TensorFlow: a copy, so that an op may reduce
    in it; a variable's value shares the variable's buffer); as is otherwise."""
    if name() != "tensorflow":
        return value
    import tensorflow as tf

    return tf.raw_ops.DeepCopy(x=value)


def sync_model_state(model) -> None:
    """Makes ``model``'s variables hold the current values, inside ``fit`` too.

    The JAX trainer keeps the training state apart from the variables between
    steps and writes it back at the end of an epoch; a callback that reads or
    assigns variables mid-epoch must have it written back first (the next step
    then starts from the variables). Other backends train the variables in place.
    """
    sync = getattr(model, "jax_state_sync", None)
    if name() == "jax" and sync is not None:
        sync()
