"""Horovod's TensorFlow helper functions built on the collectives:
``broadcast_object_fn`` and, for TF1 graphs, ``broadcast_global_variables``."""

from __future__ import annotations

from keras_dist.tensor import ops


def broadcast_object_fn(root_rank: int = 0, session=None, name: str | None = None,
                        process_set=None):
    """A function ``fn(obj)`` returning ``root_rank``'s picklable ``obj`` on every rank.

    ``session`` and ``name`` are accepted for scripts written for TF1 and not used:
    the object travels as bytes between processes, outside any graph.
    """
    del session, name

    def broadcast(obj):
        return ops.broadcast_object(obj, root_rank, process_set=process_set)

    return broadcast


def broadcast_global_variables(root_rank: int = 0):
    """Broadcasts every TF1 global variable from ``root_rank``; returns the op doing it.

    Raises:
        RuntimeError: in eager execution (TF2), which has no global variables.
    """
    import tensorflow as tf

    if tf.executing_eagerly():
        raise RuntimeError(
            "`broadcast_global_variables` works in TF1 graph mode only: eager TensorFlow "
            "has no global variables. Use `keras_dist.broadcast_variables(variables, "
            "root_rank)`, or the BroadcastGlobalVariablesCallback with Keras."
        )
    op = ops.broadcast_variables(tf.compat.v1.global_variables(), root_rank)
    return tf.no_op() if op is None else op
