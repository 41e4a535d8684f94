"""The builders of the native kernels a traced step's collectives become.

A traced TensorFlow step's grouped allreduce and allgathers run as
keras_dist's own ops (``tf.kernel``), a jitted JAX step's allreduce as its XLA
FFI handler (``jax_glue``), on the group's native engine
(``Transport.native_engine``), where the group and the call allow; each
builder here returns None where they do not, and ``conversions.run`` takes
the numpy path.
"""

from __future__ import annotations

import numpy as np

from keras_dist import _native, _vocab
from keras_dist._runtime import timeline
from keras_dist._vocab import Average, ReduceOp
from keras_dist.errors import CollectiveMismatchError
from keras_dist.tensor import allreduce_plans, gather_records, one_call
from keras_dist.tensor.native_plan import NativeReduction


def graph_kernel(op: ReduceOp, prescale: float, postscale: float, label: str, group,
                 labels: list[str] | None, plain: bool):
    """For a ``collective.Collective``'s ``graph_kernel``: the traced TF step's
    allreduce as keras_dist's own op
    (``tf.kernel``), or None where the group or the call needs the numpy path
    (also a call not ``plain``: one that reduces otherwise, as Adasum does)."""
    if not plain:
        return None
    from keras_dist.tensor.tf import kernel as tf_kernel

    # In a group of one rank nothing is reduced or counted: no op in the step
    # (a scaled call at size 1 takes the numpy path, which scales).
    return kernel_for(group, tf_kernel.identities if unscaled(prescale, postscale) else None,
                      lambda transport, engine: allreduce_builder(
                          transport, engine, op, prescale, postscale, label, group, labels),
                      tf_kernel.enabled())


def xla_kernel(op: ReduceOp, prescale: float, postscale: float, label: str, group,
               labels: list[str] | None, plain: bool):
    """For a ``collective.Collective``'s ``xla_kernel``: a jitted JAX step's
    allreduce on the CPU through
    keras_dist's XLA FFI handler (``jax_glue.native_allreduce``): a builder
    of the traced values' outputs, or of None where the group, the call (one
    not ``plain``) or JAX needs the buffer callback."""
    if not plain:
        return None

    def build(values: list) -> list | None:
        from keras_dist.tensor import jax_glue

        def call(transport, engine) -> list | None:
            dtypes = [np.dtype(v.dtype) for v in values]
            if not natively_scaled(prescale, postscale, dtypes):
                return None
            shapes = [tuple(v.shape) for v in values]
            return jax_glue.native_allreduce(values, engine, native_reduction(
                transport, op, prescale, postscale, label, group, labels, dtypes, shapes))

        # In a group of one rank nothing is reduced or counted: no call in the step.
        alone = list(values) if unscaled(prescale, postscale) else None
        return kernel_for(group, alone, call, jax_glue.native_enabled())

    return build


def unscaled(prescale: float, postscale: float) -> bool:
    return prescale == 1.0 and postscale == 1.0


def natively_scaled(prescale: float, postscale: float, dtypes: list[np.dtype]) -> bool:
    """Whether the native plan can take the call's scales: none, or floating-point
    arrays only (an integer array scaled is truncated as numpy does: the numpy
    path)."""
    return unscaled(prescale, postscale) or all(_vocab.is_float(d) for d in dtypes)


def kernel_for(group, alone, make, enabled: bool):
    """The builder a ``collective.Collective`` takes as ``graph_kernel``: ``alone`` in a
    group of one rank (None: the numpy path there too), ``make(transport,
    engine)`` where the group's transport has a native engine
    (``Transport.native_engine``), else None (the numpy path; also where the
    native op is turned off: ``enabled`` false)."""
    if not enabled:
        return None
    if group.size == 1:
        return alone
    engine = group.transport.native_engine()
    if engine is None:
        return None
    return make(group.transport, engine)


def native_reduction(transport, op: ReduceOp, prescale: float, postscale: float, label: str,
                     group, labels: list[str] | None, dtypes: list[np.dtype],
                     shapes: list[tuple]) -> NativeReduction:
    """The native plan's record (``native_plan.NativeReduction``) of an
    allreduce of arrays of ``dtypes`` and ``shapes``; its fallback does what
    the numpy path does with an engine's error, its record what it records.
    Scaled (floating-point arrays only: ``natively_scaled``), the plan sums
    an ``Average`` and multiplies it by ``postscale / size`` after, as
    ``allreduce_plans.unpack_finished`` does."""
    from keras_dist.tensor.tf import kernel as tf_kernel

    average = op is Average
    finish_op = op
    if not unscaled(prescale, postscale):
        postscale = _vocab.finishing_scale(op, np.float64, group.size, postscale)
        average, finish_op = False, (ReduceOp.SUM if op is Average else op)

    templates = [np.broadcast_to(np.zeros((), d), s) for d, s in zip(dtypes, shapes)]
    plan = allreduce_plans.allreduce_plan(templates, op, label, group.config.fusion_threshold_bytes)
    buckets, total = plan.buckets, plan.nbytes

    def fallback(index: int, srcs: list, dsts: list, error) -> tuple | None:
        bucket, _, described = buckets[index]
        kinds = [dtypes[i] for i in bucket], [shapes[i] for i in bucket]
        members = tf_kernel.as_arrays(srcs, *kinds)
        results = tf_kernel.as_arrays(dsts, *kinds)
        try:
            if isinstance(error, _native.EngineError):
                error = transport.translate_native_error(error)
            if not isinstance(error, CollectiveMismatchError):
                raise error
            allreduce_plans.parts_mismatched(transport, error, members, results, finish_op,
                                             described,
                              group.size)
        except Exception as failure:  # noqa: BLE001 - becomes the op's status
            return tf_kernel.status_of(failure, CollectiveMismatchError)
        return None

    def record(start_ns: int, end_ns: int, wait_ns: int) -> None:
        timeline.record_collective(label, "allreduce", total, start_ns, end_ns, wait_ns, labels)

    return NativeReduction(
        buckets=[(list(bucket), _vocab.dtype_code(dtype), described)
                 for bucket, dtype, described in buckets],
        op_code=_vocab.TRANSPORT_OPS[op], average=average, fallback=fallback, record=record,
        prescale=prescale, postscale=postscale)


def allreduce_builder(transport, engine, op: ReduceOp, prescale: float, postscale: float,
                       label: str, group, labels: list[str] | None):
    """``graph_kernel``'s builder on ``engine``."""
    from keras_dist.tensor.tf import kernel as tf_kernel

    def build(tensors: list) -> list | None:
        if not all(t.shape.is_fully_defined() for t in tensors) or tf_kernel.library() is None:
            return None
        dtypes = [np.dtype(t.dtype.as_numpy_dtype) for t in tensors]
        if not natively_scaled(prescale, postscale, dtypes):
            return None
        shapes = [tuple(t.shape.as_list()) for t in tensors]
        return tf_kernel.allreduce_planned(tensors, engine, native_reduction(
            transport, op, prescale, postscale, label, group, labels, dtypes, shapes))

    return build


def gather_kernel(names: list[str], group):
    """For a ``collective.Collective``'s ``graph_kernel``: a traced TF step's
    allgathers of its inputs
    (input i named ``names[i]``) as keras_dist's own op (``tf.kernel``), or
    None where the group or the op library needs the numpy path."""
    from keras_dist.tensor.tf import kernel as tf_kernel

    # In a group of one rank each rank's rows are the result: no op in the step.
    return kernel_for(group, tf_kernel.gathered_alone,
                      lambda transport, engine: gather_builder(transport, engine, names),
                      tf_kernel.enabled())


def gather_builder(transport, engine, names: list[str]):
    """``gather_kernel``'s builder on ``engine``."""
    from keras_dist.tensor.tf import kernel as tf_kernel

    def build(tensors: list) -> list | None:
        if not tf_kernel.gathers() or any(
                t.shape.rank is None or t.shape.rank > gather_records.MAX_NDIM for t in tensors):
            return None
        dtypes = [np.dtype(t.dtype.as_numpy_dtype) for t in tensors]

        def fallback(index: int, headers: bytes | None, error) -> tuple:
            try:
                if headers is not None:
                    raise gather_records.mismatch_error(
                        np.frombuffer(headers, np.int64).reshape(-1, gather_records.HEADER_WORDS),
                        dtypes[index])
                one_call.allgather_failed(error, names[index], transport)
            except Exception as failure:  # noqa: BLE001 - becomes the op's status
                return tf_kernel.status_of(failure, CollectiveMismatchError)
            raise AssertionError("unreachable: the allgather's error was not raised")

        def record(index: int, nbytes: int, start_ns: int, end_ns: int, wait_ns: int) -> None:
            timeline.record_collective(names[index], "allgather", nbytes, start_ns, end_ns,
                                       wait_ns, None)

        return tf_kernel.allgather(tensors, engine, names, dtypes, fallback, record)

    return build
