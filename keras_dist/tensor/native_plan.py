"""The record of a grouped allreduce that the native engine runs without Python.

A traced TensorFlow step (``tf.kernel``, keras_dist's op) and a jitted JAX step
(``jax_glue``, keras_dist's XLA FFI handler) hand their buffers to the same
native plan (``_native.ReductionPlan``). ``NativeReduction`` holds what the tensor
layer decides for the call (``ops``); the op or the handler adds the engine
and the tensors' sizes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence


@dataclasses.dataclass(frozen=True)
class NativeReduction:
    """A grouped allreduce as the native plan runs it."""

    #: ``[(indices into the tensors, dtype code, the name peers check)]``, one per bucket.
    buckets: list
    #: The engine's op (``_vocab.TRANSPORT_OPS``).
    op_code: int
    #: Whether a sum is divided by the group's size (an unscaled ``Average``).
    average: bool
    #: ``fallback(bucket, srcs, dsts, error)``: what the numpy path does with
    #: the engine's error for one bucket; None, or ``(code, message)`` for the
    #: op's status.
    fallback: Callable
    #: ``record(start_ns, end_ns, wait_ns)``, called while a timeline records.
    record: Callable
    #: Floating-point tensors only: each rank's input times ``prescale``
    #: before the reduction, the result times ``postscale`` after it.
    prescale: float = 1.0
    postscale: float = 1.0

    def native_plan(self, engine, nbytes: Sequence[int]):
        """The native plan (``_native.ReductionPlan``) of this reduction on ``engine``
        for tensors of ``nbytes`` bytes each."""
        from keras_dist import _native

        return _native.ReductionPlan(engine, self.buckets, self.op_code, self.average, list(nbytes),
                              self.fallback, self.record, self.prescale, self.postscale)
