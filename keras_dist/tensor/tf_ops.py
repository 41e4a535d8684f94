"""Horovod's graph ops for the process group's shape: ``size_op``, ``rank_op``,
``local_size_op``, ``local_rank_op``.

Each is a TensorFlow int32 scalar read when the op runs (not when it is
traced), so a ``tf.function`` traced once keeps reporting the group it runs in.
"""

from __future__ import annotations

import numpy as np

from keras_dist._runtime import context


def _group_op(field: str, name: str | None):
    import tensorflow as tf

    def read():
        return np.int32(getattr(context.get(), field))

    context.get()  # not initialised: fail here, not when the op runs
    value = tf.numpy_function(read, [], tf.int32, stateful=True,
                              name=name or f"keras_dist_{field}")
    value.set_shape(())
    return value


def size_op(name: str | None = None):
    """The number of ranks, as an int32 scalar tensor."""
    return _group_op("size", name)


def rank_op(name: str | None = None):
    """This process's rank, as an int32 scalar tensor."""
    return _group_op("rank", name)


def local_size_op(name: str | None = None):
    """The number of ranks on this machine, as an int32 scalar tensor."""
    return _group_op("local_size", name)


def local_rank_op(name: str | None = None):
    """This process's rank on its machine, as an int32 scalar tensor."""
    return _group_op("local_rank", name)
