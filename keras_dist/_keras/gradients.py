"""Reducing a step's gradients across ranks: the part shared by
``DistributedOptimizer`` and ``DistributedGradientTape``.

Dense gradients go through grouped allreduces (one per group; by default one
for the whole step), sparse ones (``tf.IndexedSlices``) through allgathers of
their values and indices, unless ``sparse_as_dense``. ``None`` gradients
(variables the loss does not reach) stay ``None``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from keras_dist import _vocab
from keras_dist._runtime import context, timeline
from keras_dist.tensor import checks
from keras_dist.tensor import ops as kd_ops
from keras_dist.tensor.compression import Compression


def is_indexed_slices(grad) -> bool:
    """True for a TensorFlow ``IndexedSlices`` (a sparse gradient)."""
    return type(grad).__name__ == "IndexedSlices" and type(grad).__module__.startswith(
        "tensorflow")


def to_dense(grad):
    """A sparse gradient as a dense tensor; anything else unchanged."""
    if is_indexed_slices(grad):
        import tensorflow as tf

        return tf.convert_to_tensor(grad)
    return grad


def check_groups(groups, num_groups: int = 0):
    """Validates Horovod's ``groups`` / ``num_groups`` and returns the one in force.

    Returns:
        None (one group), a whole number >= 1, or a list of lists of variables.
    """
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"`num_groups` must be a whole number >= 0. Received: "
                         f"num_groups={num_groups!r}")
    if groups is None:
        return num_groups or None
    if isinstance(groups, bool):
        raise ValueError("`groups` must be a whole number >= 1 or a list of lists of "
                         f"variables. Received: groups={groups!r}")
    if isinstance(groups, int):
        if groups < 1:
            raise ValueError("`groups` must be a whole number >= 1 or a list of lists of "
                             f"variables. Received: groups={groups!r}")
        return groups
    if isinstance(groups, (list, tuple)) and all(isinstance(g, (list, tuple)) for g in groups):
        return [list(g) for g in groups]
    raise ValueError("`groups` must be a whole number >= 1 or a list of lists of variables. "
                     f"Received: groups={groups!r}")


def _split_evenly(items: list, parts: int) -> list[list]:
    """``items`` in ``parts`` consecutive runs whose lengths differ by one at most."""
    base, extra = divmod(len(items), parts)
    runs, start = [], 0
    for part in range(parts):
        end = start + base + (1 if part < extra else 0)
        runs.append(items[start:end])
        start = end
    return [run for run in runs if run]


def _partition(indices: list[int], variables: Sequence | None, groups) -> list[list[int]]:
    """Gradient positions in the allreduce groups ``groups`` asks for, in a fixed order."""
    if groups is None or not indices:
        return [indices] if indices else []
    if isinstance(groups, int):
        return _split_evenly(indices, groups)
    if variables is None:
        raise ValueError("`groups` given as lists of variables needs the variables the "
                         "gradients belong to. Received: variables=None")
    position = {id(variables[i]): i for i in indices}
    runs, placed = [], set()
    for group in groups:
        run = [position[id(v)] for v in group
               if id(v) in position and position[id(v)] not in placed]
        placed.update(run)
        if run:
            runs.append(sorted(run))
    # Variables in no group form a group each, as in Horovod.
    runs.extend([i] for i in indices if i not in placed)
    return runs


def check_local_layers(local_layers) -> list:
    """Validates ``local_layers`` (a Keras layer, a list of them, or None)."""
    import keras

    if local_layers is None:
        return []
    if isinstance(local_layers, keras.layers.Layer):
        return [local_layers]
    local_layers = list(local_layers)
    if not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ValueError("`local_layers` must be a Keras layer or a list of Keras layers. "
                         f"Received: {[type(layer).__name__ for layer in local_layers]}")
    return local_layers


def _names(variables: Sequence | None, positions: list[int]) -> list[str]:
    """The variables' names for the timeline (nothing unless it records)."""
    if variables is None or not timeline.enabled():
        return []
    return [str(getattr(variables[i], "path", None) or getattr(variables[i], "name", i))
            for i in positions]


def divide(grad, divisor: float):
    """``grad / divisor``, an ``IndexedSlices`` staying sparse."""
    if is_indexed_slices(grad):
        import tensorflow as tf

        return tf.IndexedSlices(grad.values / float(divisor), grad.indices, grad.dense_shape)
    return grad / float(divisor)


@dataclasses.dataclass(frozen=True)
class GradientReduction:
    """How a step's gradients are reduced (the options both wrappers share).

    ``process_set`` (None: every rank) is the set the gradients are reduced
    over; on a rank outside it they stay this rank's own. Gradients of local
    variables (see ``reduce``) are not communicated; with
    ``scale_local_gradients`` they are divided by the number of ranks of the
    set, so that the sum over ranks of an update is of the same size for
    local and shared variables.
    """

    op: _vocab.ReduceOp = _vocab.Average
    compression: type = Compression.none
    sparse_as_dense: bool = False
    gradient_predivide_factor: float = 1.0
    groups: object = None  # None, a whole number >= 1, or lists of variables
    process_set: object = None
    scale_local_gradients: bool = True

    def __post_init__(self) -> None:
        checks.check_op(self.op)  # as the collectives check it
        if self.compression not in (Compression.none, Compression.fp16):
            raise ValueError(
                "`compression` must be keras_dist.Compression.none or "
                f"keras_dist.Compression.fp16. Received: compression={self.compression!r}")
        if self.gradient_predivide_factor <= 0:
            raise ValueError("`gradient_predivide_factor` must be > 0. Received: "
                             f"gradient_predivide_factor={self.gradient_predivide_factor}")
        if self.gradient_predivide_factor != 1.0 and self.op is not _vocab.Average:
            raise ValueError(
                "`gradient_predivide_factor` needs op=keras_dist.Average. Received: "
                f"op={self.op}, gradient_predivide_factor={self.gradient_predivide_factor}")

    def span(self) -> tuple[int, bool]:
        """``(ranks in the reduction, whether this rank takes part)``."""
        if self.process_set is None:
            return context.get().size, True
        size = self.process_set.size()
        if size is None:
            raise ValueError(
                "`process_set` must be registered (by `keras_dist.init(process_sets=...)` "
                f"or `keras_dist.add_process_set`) before use. Received: {self.process_set!r}")
        return int(size), bool(self.process_set.included())

    def reduce(self, grads: Sequence, variables: Sequence | None,
               local: Collection[int] = ()) -> list:
        """``grads`` reduced across the ranks, in their order.

        Args:
            grads: one gradient (or None) per variable, in an order every rank shares.
            variables: the variables, or None when ``groups`` is not given as
                lists and ``local`` is empty.
            local: ``id``s of the variables whose gradients stay on this rank.
        """
        size, included = self.span()
        reduced = list(grads)
        local_positions = set()
        if local:
            local_positions = {i for i, v in enumerate(variables) if id(v) in local}
        if (size > 1 or not context.get().config.size_one_shortcut) and included:
            shared = [i for i in range(len(reduced)) if i not in local_positions]
            results = self._reduce_shared(
                [reduced[i] for i in shared],
                None if variables is None else [variables[i] for i in shared], size)
            for index, result in zip(shared, results):
                reduced[index] = result
        if self.scale_local_gradients and size > 1:
            for index in local_positions:
                if reduced[index] is not None:
                    reduced[index] = divide(reduced[index], size)
        return reduced

    def _reduce_shared(self, grads: list, variables: list | None, size: int) -> list:
        op, prescale, postscale = self.op, 1.0, 1.0
        if self.op is _vocab.Average and self.gradient_predivide_factor != 1.0:
            # Sum, scaled by 1/f before and f/size after: an average split in two.
            op = _vocab.Sum
            prescale = 1.0 / self.gradient_predivide_factor
            postscale = self.gradient_predivide_factor / size
        reduced = list(grads)
        dense, sparse = [], []
        for index, grad in enumerate(grads):
            if grad is None:
                continue
            if is_indexed_slices(grad) and not self.sparse_as_dense:
                sparse.append(index)
                continue
            reduced[index] = to_dense(grad)
            dense.append(index)
        for run in _partition(dense, variables, self.groups):
            with timeline.tensor_names(_names(variables, run)):
                results = kd_ops.grouped_allreduce_gradients(
                    [reduced[i] for i in run], op, prescale_factor=prescale,
                    postscale_factor=postscale, compression=self.compression,
                    process_set=self.process_set)
            for index, result in zip(run, results):
                reduced[index] = result
        for index in sparse:
            reduced[index] = self._allgather_slices(grads[index], size)
        return reduced

    def _allgather_slices(self, grad, size: int):
        import tensorflow as tf

        if self.op not in (_vocab.Average, _vocab.Sum):
            raise ValueError(
                "Sparse (IndexedSlices) gradients can be reduced with op=Average or Sum "
                f"only; pass sparse_as_dense=True for other ops. Received: op={self.op}")
        values, compressed = self.compression.compress(grad.values)
        values, indices = kd_ops.gather_rows(values, grad.indices,
                                             process_set=self.process_set)
        values = self.compression.decompress(values, compressed)
        if self.op is _vocab.Average:
            values = values / tf.cast(size, values.dtype)
        return tf.IndexedSlices(values, indices, grad.dense_shape)
