"""DistributedGradientTape: a ``tf.GradientTape`` whose gradients come back reduced."""

from __future__ import annotations

from keras_dist import _vocab
from keras_dist._keras.gradients import GradientReduction, check_groups, check_local_layers
from keras_dist.tensor.compression import Compression
from keras_dist.tensor.tf.errors import not_converted_by_autograph


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape``: ``gradient()`` returns gradients reduced across ranks.

    The wrapper holds the tape (composition); everything but ``gradient`` is
    the tape's own. All gradients of one call go through one grouped
    allreduce (or ``groups`` of them), in the order of ``sources``, which
    must be the same on every rank. It works eagerly and inside a
    ``tf.function``. Gradients of sources registered with
    ``register_local_source`` are not reduced (and, with
    ``scale_local_gradients``, divided by the number of ranks, as Horovod
    does).

    Args:
        tape: the ``tf.GradientTape`` that recorded the computation.
        op: ``keras_dist.Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        compression: ``Compression.none`` or ``Compression.fp16``.
        sparse_as_dense: reduce ``IndexedSlices`` gradients as dense tensors
            (otherwise their values and indices are allgathered).
        gradient_predivide_factor: with ``Average``, scale by ``1/f`` before
            the sum and by ``f/size`` after it.
        num_groups: Horovod's older spelling of ``groups`` as a number.
        groups: a whole number ``k`` (the gradients split into ``k``
            allreduces of consecutive gradients) or a list of lists of
            variables (each list one allreduce; variables in no list one each).
        process_set: the ranks to reduce over (default: every rank); on a
            rank outside the set the gradients stay its own.
        scale_local_gradients: divide local sources' gradients by the size.

    Example:

    ```python
    with tf.GradientTape() as tape:
        loss = loss_fn(model(x, training=True), y)
    tape = kd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    ```
    """

    def __init__(self, tape, *, op=_vocab.Average, compression=Compression.none,
                 sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, groups=None, process_set=None,
                 scale_local_gradients: bool = True):
        if isinstance(tape, DistributedGradientTape):
            raise ValueError("`tape` must not already be a DistributedGradientTape. "
                             f"Received: tape={tape!r}")
        if not hasattr(tape, "gradient") or not hasattr(tape, "watch"):
            raise ValueError(f"`tape` must be a tf.GradientTape. Received: tape={tape!r}")
        self._tape = tape
        self._reduction = GradientReduction(
            op=op, compression=compression, sparse_as_dense=bool(sparse_as_dense),
            gradient_predivide_factor=float(gradient_predivide_factor),
            groups=check_groups(groups, num_groups), process_set=process_set,
            scale_local_gradients=bool(scale_local_gradients))
        self._local_sources: set[int] = set()

    def __getattr__(self, name):
        # Only reached for what this wrapper does not define: the tape's own API.
        return getattr(self._tape, name)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc_info):
        return self._tape.__exit__(*exc_info)

    def register_local_source(self, source) -> None:
        """Marks ``source`` as local to this rank: its gradient is not reduced."""
        self._local_sources.add(id(source))

    @not_converted_by_autograph
    def gradient(self, target, sources, output_gradients=None, **kwargs):
        """The tape's gradients of ``target`` w.r.t. ``sources``, reduced across ranks.

        Takes the arguments of ``tf.GradientTape.gradient`` and returns the same
        structure.
        """
        import tensorflow as tf

        gradients = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(gradients, expand_composites=False)
        reduced = self._reduction.reduce(flat_grads, flat_sources, self._local_sources)
        return tf.nest.pack_sequence_as(gradients, reduced)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None):
        """``(local, global)`` lists of ``(source, gradient)`` pairs, as Horovod returns."""
        grads = self.gradient(target, sources, output_gradients)
        local, shared = [], []
        for source, grad in zip(sources, grads):
            (local if id(source) in self._local_sources else shared).append((source, grad))
        return local, shared


def PartialDistributedGradientTape(tape, *, local_layers=None, **kwargs):  # noqa: N802
    """A ``DistributedGradientTape`` that leaves the gradients of ``local_layers`` local.

    Args:
        tape: the ``tf.GradientTape``.
        local_layers: a Keras layer or a list of them whose trainable weights
            keep their own gradients on each rank.
        **kwargs: as for ``DistributedGradientTape``.
    """
    local_layers = check_local_layers(local_layers)
    wrapped = DistributedGradientTape(tape, **kwargs)
    for layer in local_layers:
        for variable in layer.trainable_weights:
            wrapped.register_local_source(variable)
    return wrapped
