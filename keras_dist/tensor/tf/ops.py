"""The TensorFlow side of the tensor layer.

Horovod's graph ops for the process group's shape (``size_op``, ``rank_op``,
``local_size_op``, ``local_rank_op``) and the gradients of the collectives
(``conversions.run`` attaches them; the collectives a gradient runs are given
to its factory, so this module never imports ``ops``). TensorFlow is imported
only when one of these runs.
"""

from __future__ import annotations

import numpy as np

from keras_dist._runtime import context
from keras_dist._vocab import Average, ReduceOp


def _group_of(process_set_id: int):
    """The group of the process set numbered ``process_set_id`` (0: the job)."""
    if isinstance(process_set_id, bool) or not isinstance(process_set_id, (int, np.integer)):
        raise ValueError("`process_set_id` must be an integer. "
                         f"Received: process_set_id={process_set_id!r}")
    if process_set_id == 0:
        return context.get()
    try:
        from keras_dist import process_sets
    except ImportError:
        raise ValueError("`process_set_id` must be 0: this build has no process sets. "
                         f"Received: process_set_id={process_set_id}") from None
    return context.group_for(process_sets.by_id(int(process_set_id)))


def _group_op(field: str, name: str | None, process_set_id: int = 0):
    import tensorflow as tf

    def read():
        return np.int32(getattr(_group_of(process_set_id), field))

    _group_of(process_set_id)  # not initialised, or no such set: fail here, not when it runs
    value = tf.numpy_function(read, [], tf.int32, stateful=True,
                              name=name or f"keras_dist_{field}")
    value.set_shape(())
    return value


def size_op(process_set_id: int = 0, name: str | None = None):
    """The number of ranks (of the process set ``process_set_id``), as an int32 scalar tensor.

    Read when the op runs, not when it is traced, so a ``tf.function`` traced
    once keeps reporting the group it runs in.
    """
    return _group_op("size", name, process_set_id)


def rank_op(process_set_id: int = 0, name: str | None = None):
    """This process's rank (in the process set ``process_set_id``), as an int32 scalar tensor."""
    return _group_op("rank", name, process_set_id)


def local_size_op(name: str | None = None):
    """The number of ranks on this machine, as an int32 scalar tensor."""
    return _group_op("local_size", name)


def local_rank_op(name: str | None = None):
    """This process's rank on its machine, as an int32 scalar tensor."""
    return _group_op("local_rank", name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None):
    """1 if this process belongs to the process set ``process_set_id``, else 0, as an
    int32 scalar tensor."""
    import tensorflow as tf

    from keras_dist import process_sets

    included = process_sets.by_id(process_set_id).included()  # fails here for an unknown id
    return tf.constant(np.int32(included), name=name or "keras_dist_process_set_included")


def indexed_slices(values, indices, dense_shape, divide_by: int | None):
    """The ``IndexedSlices`` of gathered ``values`` and ``indices``, values divided
    by ``divide_by`` when given (TF division: integers become floats)."""
    import tensorflow as tf

    if divide_by is not None:
        values = values / tf.cast(divide_by, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=dense_shape)


# ---------------------------------------------------------------------------
# Gradients, as ``collective.GradFn``s: the gradient of a collective is a
# collective over the same process set.


def _floating(tensors: list) -> list[int]:
    return [i for i, t in enumerate(tensors) if t.dtype.is_floating or t.dtype.is_complex]


def allreduce_grad(grouped_allreduce, op: ReduceOp, prescale: float, postscale: float,
                   process_set):
    """The gradient of a (grouped) allreduce: the same allreduce of the gradients
    (``grouped_allreduce``: the public collective)."""

    def grad(inputs: list, outputs: list, upstream: list) -> list:
        grads: list = [None] * len(inputs)
        floating = _floating(inputs)
        reduced = grouped_allreduce([upstream[i] for i in floating], op=op,
                                        prescale_factor=prescale, postscale_factor=postscale,
                                        process_set=process_set)
        for i, g in zip(floating, reduced):
            grads[i] = g
        return grads

    return grad


def allgather_grad(allgather, allreduce, process_set):
    """The gradient of an allgather: the average gradient's rows this rank gave
    (``allgather``, ``allreduce``: the public collectives)."""

    def grad(inputs: list, outputs: list, upstream: list) -> list:
        import tensorflow as tf

        x = inputs[0]
        if not (x.dtype.is_floating or x.dtype.is_complex):
            return [None]
        group = context.group_for(process_set)
        rows = tf.shape(tf.reshape(x, [-1]) if x.shape.rank == 0 else x)[:1]
        sizes = allgather(rows, process_set=process_set)
        with tf.control_dependencies([sizes]):  # the same order on every rank
            reduced = allreduce(upstream[0], op=Average, process_set=process_set)
        mine = tf.split(reduced, sizes, num=group.size, axis=0)[group.rank]
        return [tf.reshape(mine, tf.shape(x))]

    return grad


def broadcast_grad(allreduce, root: int, rank: int, process_set):
    """The gradient of a broadcast: the average gradient on the root, zeros elsewhere
    (``allreduce``: the public collective)."""

    def grad(inputs: list, outputs: list, upstream: list) -> list:
        import tensorflow as tf

        if not (inputs[0].dtype.is_floating or inputs[0].dtype.is_complex):
            return [None]
        reduced = allreduce(upstream[0], op=Average, process_set=process_set)
        if rank == root:
            return [reduced]
        with tf.control_dependencies([reduced]):  # every rank runs the allreduce
            return [tf.zeros_like(reduced)]

    return grad
