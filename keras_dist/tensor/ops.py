"""The tensor layer: collectives on numpy, TF (eager and graph) and cupy values.

Every public collective takes a value of one of those kinds and returns the
same kind, dtype and shape; the input is never modified. Underneath, values
become flat numpy buffers handed to the process group's transport, grouped
by dtype into fused buckets (``fusion.py``).
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Sequence

import numpy as np

from keras_dist import _native, _vocab
from keras_dist._runtime import context, timeline
from keras_dist._vocab import Average, ReduceOp
from keras_dist.errors import CollectiveMismatchError
from keras_dist.tensor import adasum, conversions, fusion, outputs, tf_ops
from keras_dist.tensor.compression import Compression
from keras_dist.tensor.conversions import (
    dtype_of,
    is_cupy,
    is_indexed_slices,
    is_symbolic,
    not_converted_by_autograph,
    raising_tf_errors,
    run,
    unwrap,
)
from keras_dist.tensor.counters import COUNTERS
from keras_dist.transports.joinable import JoinableTransport
from keras_dist.transports.shm import NATIVE_ERRORS as _NATIVE_ERRORS
from keras_dist.transports.shm import ShmTransport
from keras_dist.transports.shm import translate as _translate

# ---------------------------------------------------------------------------
# Argument checks. Every collective makes them before anything else, at any
# size (a call that fails at 2 ranks fails the same way at 1).


def _check_op(op, average: bool | None = None) -> ReduceOp:
    """``op``, or the op the legacy ``average`` flag names (True: Average, False: Sum)."""
    if average is not None:
        if op is not None:
            raise ValueError(
                "Pass `op` or the legacy `average`, not both. "
                f"Received: op={op!r}, average={average!r}"
            )
        return Average if average else _vocab.Sum
    if op is None:
        return Average
    if not isinstance(op, ReduceOp):
        raise ValueError(
            "`op` must be one of keras_dist.Average, Sum, Min, Max, Product. "
            f"Received: op={op!r}"
        )
    return op


def _check_root(root_rank, group) -> int:
    """The position in ``group`` of ``root_rank``, a job rank (as in Horovod,
    also for a process set's collectives)."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)):
        raise ValueError(f"`root_rank` must be an integer. Received: root_rank={root_rank!r}")
    if int(root_rank) not in group.ranks:
        if group.process_set_id == 0:
            raise ValueError("`root_rank` must be in [0, size). "
                             f"Received: root_rank={root_rank} (size={group.size})")
        raise ValueError("`root_rank` must be one of the process set's ranks "
                         f"{list(group.ranks)}. Received: root_rank={root_rank}")
    return group.ranks.index(int(root_rank))


def _check_dtypes(dtypes: Sequence[np.dtype], collective: str) -> None:
    for dtype in dict.fromkeys(dtypes):  # each dtype once (a step's gradients share one)
        if not _vocab.is_supported(dtype):
            raise TypeError(
                f"`{collective}` supports {_vocab.SUPPORTED_DTYPE_NAMES}. "
                f"Received: dtype={np.dtype(dtype).name}"
            )


def _check_byte_dtypes(dtypes: Sequence[np.dtype], collective: str) -> None:
    """Broadcasts and allgathers move bytes: any fixed-size number or bool travels unchanged."""
    for dtype in dtypes:
        if not (_vocab.is_supported(dtype) or np.dtype(dtype).kind in "biufc"):
            raise TypeError(
                f"`{collective}` supports booleans and numbers. "
                f"Received: dtype={np.dtype(dtype).name}"
            )


# ---------------------------------------------------------------------------
# Numpy cores: flat buffers through the transport.


def _check_allreduce_inputs(dtypes: Sequence[np.dtype]) -> None:
    _check_dtypes(dtypes, "allreduce")


def _scaled(array: np.ndarray, factor: float, out: np.ndarray | None = None) -> np.ndarray:
    """``array * factor`` in ``array``'s dtype (into ``out`` when given)."""
    if out is None:
        out = np.empty_like(array)
    np.multiply(array, _vocab.typed_factor(factor, array.dtype), out=out, casting="unsafe")
    return out


def _allreduce_numpy(x: np.ndarray, op: ReduceOp, prescale: float, postscale: float,
                     name: str, group=None) -> np.ndarray:
    """``allreduce`` of one numpy array: reduced in its fresh output, no fusion."""
    group = group or context.get()
    _check_allreduce_inputs([x.dtype])
    if group.size == 1:
        if prescale == 1.0 and postscale == 1.0:
            return x
        out = _scaled(x, prescale) if prescale != 1.0 else x.copy()
        return _scaled(out, postscale, out=out) if postscale != 1.0 else out
    out = outputs.POOL.empty(x.shape, x.dtype)
    send = None  # the transport reads ``x`` itself: no copy into ``out`` first
    if prescale != 1.0:
        _scaled(x, prescale, out=out)
    elif x.flags.c_contiguous:
        send = x.reshape(-1)
    else:
        np.copyto(out, x)
    if out.size:
        with timeline.activity(name, "allreduce", out.nbytes, group.transport):
            group.transport.allreduce(out.reshape(-1), _vocab.TRANSPORT_OPS[op], name=_describe(
                f"{name} {op.value}", ((x.shape, x.dtype.str),), 1), send=send)
        COUNTERS["allreduce"] += 1
    _vocab.finish_reduction(out, op, group.size, postscale)
    return out


@functools.lru_cache(maxsize=1024)
def _describe(prefix: str, members: tuple, group_length: int) -> str:
    """The name a transport checks ranks agree on: the call and its bucket's shapes.

    Cached: training steps repeat the same calls.
    """
    shapes = " ".join(f"{np.dtype(d).name}{list(shape)}" for shape, d in members)
    return f"{prefix} [{len(members)} of {group_length} tensors: {shapes}]"


#: Recent grouped allreduces' plans by (name, op, fusion threshold, every
#: array's shape and dtype): a training step makes the same call every step.
#: A plan: the buckets (indices, dtype, the name peers check), where each
#: result starts in the aligned region of results and the region's size
#: (``fusion.aligned_offsets``), and the arrays' bytes.
_PLANS: dict[tuple, tuple] = {}
_MAX_PLANS = 64


def _allreduce_plan(arrays: list[np.ndarray], op: ReduceOp, name: str,
                    threshold: int) -> tuple:
    """``arrays``' plan (``_PLANS``), made and checked the first time."""
    key = (name, op, threshold, *[(a.shape, a.dtype) for a in arrays])
    plan = _PLANS.get(key)
    if plan is None:
        _check_allreduce_inputs([a.dtype for a in arrays])
        prefix = f"{name} {op.value}"
        buckets = [(bucket, arrays[bucket[0]].dtype,
                    _describe(prefix, tuple((arrays[i].shape, arrays[i].dtype.str)
                                            for i in bucket), len(arrays)))
                   for bucket in fusion.plan_buckets(arrays, threshold)]
        nbytes = [a.nbytes for a in arrays]
        plan = (buckets, *fusion.aligned_offsets(nbytes), sum(nbytes))
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _allreduce_arrays(arrays: list[np.ndarray], op: ReduceOp, prescale: float,
                      postscale: float, name: str, group=None,
                      labels: list[str] | None = None,
                      results: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """The allreduce of ``arrays``: new arrays, or ``results`` (arrays of the
    same shapes and dtypes, ``arrays`` themselves for one in place) filled."""
    group = group or context.get()
    if group.size == 1:
        _check_allreduce_inputs([a.dtype for a in arrays])
        if prescale == 1.0 and postscale == 1.0:
            return arrays
        return [_allreduce_numpy(a, op, prescale, postscale, name, group) for a in arrays]
    transport = group.transport
    buckets, offsets, total, nbytes = _allreduce_plan(arrays, op, name,
                                                      group.config.fusion_threshold_bytes)
    # Every result is a view of one aligned buffer, in the order of `arrays`:
    # one allocation, and no copy when a traced TensorFlow step takes them
    # (as that buffer, `conversions`) from tf.numpy_function.
    outputs = results if results is not None else fusion.aligned_views(arrays, offsets, total)
    # The shm transport reduces a bucket from the arrays straight into the
    # results, without a fused buffer, when nothing is scaled but an Average.
    reduce_parts = prescale == 1.0 and postscale == 1.0 and callable(
        getattr(transport, "allreduce_parts", None))
    with timeline.activity(name, "allreduce", nbytes, transport, labels):
        for bucket, _, described in buckets:
            if len(bucket) == len(arrays):  # one bucket: every array
                members, results = arrays, outputs
            else:
                members = [arrays[i] for i in bucket]
                results = [outputs[i] for i in bucket]
            if reduce_parts:
                _allreduce_parts(transport, members, results, op, described, group.size)
            else:
                _reduce_fused(transport, members, results, op, described, group.size, prescale,
                              postscale)
            COUNTERS["allreduce"] += 1
    return outputs


def _reduce_fused(transport, members: list[np.ndarray], results: list[np.ndarray],
                  op: ReduceOp, described: str, size: int, prescale: float,
                  postscale: float) -> None:
    """The allreduce of one bucket packed into the transport's buffer, into ``results``."""
    dtype = members[0].dtype
    count = sum(a.size for a in members)
    flat = transport.scratch(count * dtype.itemsize).view(dtype)
    fusion.pack(members, flat, _vocab.typed_factor(prescale, dtype))
    moved = transport.allreduce(flat, _vocab.TRANSPORT_OPS[op], name=described)
    if moved is not None:  # ranks have joined: the result is elsewhere
        flat = moved
    # ``flat`` may be shared memory that peers still read: only read it now.
    _unpack_finished(flat, members, results, op, size, postscale)


def _unpack_finished(flat: np.ndarray, members: list[np.ndarray], results: list[np.ndarray],
                     op: ReduceOp, size: int, postscale: float) -> None:
    """Writes the transport's reduction ``flat`` of ``members`` into ``results``
    as ``op``'s result (times ``postscale``)."""
    dtype = members[0].dtype
    scale = _vocab.finishing_scale(op, dtype, size, postscale)
    fusion.unpack(flat, members, 1.0 if scale is None else _vocab.typed_factor(scale, dtype),
                  out=results)
    if scale is None:
        for result in results:
            _vocab.finish_reduction(result, op, size, postscale)


def _allreduce_parts(transport, members: list[np.ndarray], results: list[np.ndarray],
                     op: ReduceOp, described: str, size: int) -> None:
    """The allreduce of one bucket by ``transport.allreduce_parts`` into ``results``."""
    code = _vocab.TRANSPORT_OPS[op]
    try:
        transport.allreduce_parts(members, results, code, op is Average, described)
    except CollectiveMismatchError as error:
        _parts_mismatched(transport, error, members, results, op, described, size)


def _parts_mismatched(transport, error: CollectiveMismatchError, members: list[np.ndarray],
                      results: list[np.ndarray], op: ReduceOp, described: str,
                      size: int) -> None:
    """After ``allreduce_parts`` of a bucket raised ``error``: the bucket's result
    with the joined ranks' part when ranks have joined (as the general path),
    else ``error`` raised."""
    mismatched = getattr(transport, "allreduce_mismatched", None)
    if mismatched is None:
        raise error
    flat = np.empty(sum(a.size for a in members), members[0].dtype)
    fusion.pack(members, flat)
    _unpack_finished(mismatched(error, flat, _vocab.TRANSPORT_OPS[op], described), members,
                     results, op, size, 1.0)


def _graph_kernel(op: ReduceOp, prescale: float, postscale: float, label: str, group,
                  labels: list[str] | None, reduce_arrays):
    """For ``conversions.run``: the traced TF step's allreduce as keras_dist's own op
    (``tf_kernel``), or None where the group or the call needs the numpy path."""
    if reduce_arrays is not _allreduce_arrays:
        return None
    from keras_dist.tensor import tf_kernel

    # In a group of one rank nothing is reduced or counted: no op in the step
    # (a scaled call at size 1 takes the numpy path, which scales).
    return _kernel_for(group, tf_kernel.identities if _unscaled(prescale, postscale) else None,
                       lambda transport, engine: _allreduce_builder(
                           transport, engine, op, prescale, postscale, label, group, labels),
                       tf_kernel.enabled())


def _xla_kernel(op: ReduceOp, prescale: float, postscale: float, label: str, group,
                labels: list[str] | None, reduce_arrays):
    """For ``conversions.run``: a jitted JAX step's allreduce on the CPU through
    keras_dist's XLA FFI handler (``jax_glue.native_allreduce``): a builder
    of the traced values' outputs, or of None where the group, the call or
    JAX needs the buffer callback."""
    if reduce_arrays is not _allreduce_arrays:
        return None

    def build(values: list) -> list | None:
        from keras_dist.tensor import jax_glue

        def call(transport, engine) -> list | None:
            dtypes = [np.dtype(v.dtype) for v in values]
            if not _natively_scaled(prescale, postscale, dtypes):
                return None
            shapes = [tuple(v.shape) for v in values]
            return jax_glue.native_allreduce(values, engine, *_native_plan_parts(
                transport, op, prescale, postscale, label, group, labels, dtypes, shapes))

        # In a group of one rank nothing is reduced or counted: no call in the step.
        alone = list(values) if _unscaled(prescale, postscale) else None
        return _kernel_for(group, alone, call, jax_glue.native_enabled())

    return build


def _unscaled(prescale: float, postscale: float) -> bool:
    return prescale == 1.0 and postscale == 1.0


def _natively_scaled(prescale: float, postscale: float, dtypes: list[np.dtype]) -> bool:
    """Whether the native plan can take the call's scales: none, or floating-point
    arrays only (an integer array scaled is truncated as numpy does: the numpy
    path)."""
    return _unscaled(prescale, postscale) or all(_vocab.is_float(d) for d in dtypes)


def _kernel_for(group, alone, make, enabled: bool):
    """The builder ``conversions.run`` takes as ``graph_kernel``: ``alone`` in a
    group of one rank (None: the numpy path there too), ``make(transport,
    engine)`` where the group runs on one machine's shm engine, else None (the
    numpy path; also where the native op is turned off: ``enabled`` false)."""
    if not enabled:
        return None
    if group.size == 1:
        return alone
    shm = _one_call_transport(group)
    if shm is None or shm.engine is None:
        return None
    return make(group.transport, shm.engine)


def _native_plan_parts(transport, op: ReduceOp, prescale: float, postscale: float, label: str,
                       group, labels: list[str] | None, dtypes: list[np.dtype],
                       shapes: list[tuple]) -> tuple:
    """What ``_native.TfPlan`` takes, but the engine and the sizes, for an
    allreduce of arrays of ``dtypes`` and ``shapes``: ``(buckets, op code,
    average, fallback, record, prescale, postscale)``; the fallback does what
    the numpy path does with an engine's error, the record what it records.
    Scaled (floating-point arrays only: ``_natively_scaled``), the plan sums
    an ``Average`` and multiplies it by ``postscale / size`` after, as
    ``_unpack_finished`` does."""
    from keras_dist.tensor import tf_kernel

    average = op is Average
    finish_op = op
    if not _unscaled(prescale, postscale):
        postscale = _vocab.finishing_scale(op, np.float64, group.size, postscale)
        average, finish_op = False, (ReduceOp.SUM if op is Average else op)

    templates = [np.broadcast_to(np.zeros((), d), s) for d, s in zip(dtypes, shapes)]
    buckets, _, _, total = _allreduce_plan(templates, op, label,
                                           group.config.fusion_threshold_bytes)

    def fallback(index: int, srcs: list, dsts: list, error) -> tuple | None:
        bucket, _, described = buckets[index]
        kinds = [dtypes[i] for i in bucket], [shapes[i] for i in bucket]
        members = tf_kernel.as_arrays(srcs, *kinds)
        results = tf_kernel.as_arrays(dsts, *kinds)
        try:
            if isinstance(error, _NATIVE_ERRORS):
                error = _translate(error)
            if not isinstance(error, CollectiveMismatchError):
                raise error
            _parts_mismatched(transport, error, members, results, finish_op, described,
                              group.size)
        except Exception as failure:  # noqa: BLE001 - becomes the op's status
            return tf_kernel.status_of(failure, CollectiveMismatchError)
        return None

    def record(start_ns: int, end_ns: int, wait_ns: int) -> None:
        timeline.record_collective(label, "allreduce", total, start_ns, end_ns, wait_ns, labels)

    return ([(list(bucket), _vocab.dtype_code(dtype), described)
             for bucket, dtype, described in buckets],
            _vocab.TRANSPORT_OPS[op], average, fallback, record, prescale, postscale)


def _allreduce_builder(transport, engine, op: ReduceOp, prescale: float, postscale: float,
                       label: str, group, labels: list[str] | None):
    """``_graph_kernel``'s builder on ``engine``."""
    from keras_dist.tensor import tf_kernel

    def build(tensors: list) -> list | None:
        if not all(t.shape.is_fully_defined() for t in tensors) or tf_kernel.library() is None:
            return None
        dtypes = [np.dtype(t.dtype.as_numpy_dtype) for t in tensors]
        if not _natively_scaled(prescale, postscale, dtypes):
            return None
        shapes = [tuple(t.shape.as_list()) for t in tensors]
        return tf_kernel.allreduce(tensors, engine, *_native_plan_parts(
            transport, op, prescale, postscale, label, group, labels, dtypes, shapes))

    return build


def _broadcast_arrays(arrays: list[np.ndarray], root: int, name: str,
                      group=None) -> list[np.ndarray]:
    group = group or context.get()
    if group.size == 1:
        return arrays
    outputs = [np.array(a, copy=True) for a in arrays]
    with timeline.activity(name, "broadcast", sum(a.nbytes for a in arrays),
                           group.transport):
        for bucket in fusion.plan_buckets(outputs, group.config.fusion_threshold_bytes):
            members = [outputs[i] for i in bucket]
            dtype = members[0].dtype
            count = sum(a.size for a in members)
            flat = np.empty(count, dtype) if len(members) > 1 else members[0].reshape(-1)
            if len(members) > 1 and group.rank == root:
                fusion.pack(members, flat)
            group.transport.broadcast(flat.view(np.uint8), root, name=_describe(
                name, tuple((a.shape, a.dtype.str) for a in members), len(arrays)))
            COUNTERS["broadcast"] += 1
            if len(members) > 1:
                for index, result in zip(bucket, fusion.unpack(flat, members)):
                    outputs[index] = result
    return outputs


_MAX_GATHER_NDIM = 8


def _dtype_name(number: int) -> str:
    """The name of the numpy dtype whose type number is ``number``."""
    for code in np.typecodes["All"]:
        if np.dtype(code).num == number:
            return np.dtype(code).name
    return f"dtype #{number}"


_GATHER_HEADER = 2 + _MAX_GATHER_NDIM
#: An allgather's first step gathers a record from every rank, int64 words
#: ``[used bytes, inline, ndim, dtype.num, *shape padded to 8]`` followed, when
#: the rank's data has at most ``_GATHER_INLINE`` bytes (``inline`` 1), by the
#: data itself; the data step runs only when some rank's data did not fit.
#: Transports copy only each record's used bytes where they can
#: (``allgather_records``). native/src/bindings.cc keeps the same layout.
_GATHER_INLINE = 4096
_GATHER_RECORD_WORDS = 2 + _GATHER_HEADER
_GATHER_RECORD = 8 * _GATHER_RECORD_WORDS + _GATHER_INLINE


def _gather_mismatch(headers: np.ndarray, dtype: np.dtype) -> CollectiveMismatchError:
    """The error for ranks whose allgather headers (``[ndim, dtype.num, *shape]``
    per rank; this rank's dtype is ``dtype``) disagree."""
    shapes = [tuple(int(d) for d in h[2 : 2 + h[0]]) for h in headers]
    names = {int(h[1]): _dtype_name(int(h[1])) for h in headers}
    names[dtype.num] = dtype.name
    detail = ", ".join(f"rank {r}: shape={shape} dtype={names[int(h[1])]}"
                       for r, (h, shape) in enumerate(zip(headers, shapes)))
    return CollectiveMismatchError(
        "`allgather` needs the same dtype and the same shape past the first "
        f"dimension on every rank. Received: {detail}"
    )


def _allgather_array(array: np.ndarray, name: str, group=None) -> np.ndarray:
    group = group or context.get()
    array = np.ascontiguousarray(array)
    if array.ndim == 0:
        array = array.reshape(1)
    _check_byte_dtypes([array.dtype], "allgather")
    if array.ndim > _MAX_GATHER_NDIM:
        raise ValueError(f"`allgather` takes at most {_MAX_GATHER_NDIM} dimensions. "
                         f"Received: shape={array.shape}")
    if group.size == 1:
        return array.copy()
    # Shapes first (ranks may differ in the first dimension only), with the
    # data of small arrays in the same records.
    record = np.zeros(_GATHER_RECORD, np.uint8)
    words = record[: 8 * _GATHER_RECORD_WORDS].view(np.int64)
    inline = array.nbytes <= _GATHER_INLINE
    words[0] = 8 * _GATHER_RECORD_WORDS + (array.nbytes if inline else 0)
    words[1:4] = inline, array.ndim, array.dtype.num
    words[4 : 4 + array.ndim] = array.shape
    if inline:
        record[8 * _GATHER_RECORD_WORDS : words[0]] = array.reshape(-1).view(np.uint8)
    records = np.empty((group.size, _GATHER_RECORD), np.uint8)
    # On the timeline: this step is the allgather itself for a rank whose data it carries.
    step = name if inline else f"{name} shapes"
    with timeline.activity(step, "allgather", records.nbytes, group.transport):
        group.transport.allgather_records(record, records.reshape(-1), name=f"{name} shapes")
    words = records.view(np.int64)
    headers = words[:, 2:_GATHER_RECORD_WORDS]
    shapes = [tuple(int(d) for d in h[2 : 2 + h[0]]) for h in headers]
    if any((h[0], h[1]) != (headers[0][0], headers[0][1]) or shape[1:] != shapes[0][1:]
           for h, shape in zip(headers, shapes)):
        raise _gather_mismatch(headers, array.dtype)
    row_bytes = int(np.prod(array.shape[1:], dtype=np.int64)) * array.dtype.itemsize
    counts = [shape[0] * row_bytes for shape in shapes]
    out = outputs.POOL.empty((sum(shape[0] for shape in shapes), *array.shape[1:]), array.dtype)
    flat = out.reshape(-1).view(np.uint8)
    if words[:, 1].all():
        start = 0
        for rank, count in enumerate(counts):
            flat[start : start + count] = records[rank, 8 * _GATHER_RECORD_WORDS :][:count]
            start += count
    else:
        with timeline.activity(name, "allgather", out.nbytes, group.transport):
            group.transport.allgatherv(array.reshape(-1).view(np.uint8), flat, counts, name=name)
    COUNTERS["allgather"] += 1
    return out


# ---------------------------------------------------------------------------
# One-call paths. A small C-contiguous numpy array, with no option set, on the
# job's shm transport goes to the engine in one native call
# (``_native.dispatch_*``), which finds the engine (the job's group, no
# timeline recording), validates the array, names the call as the general
# path does (``_describe``: peers may take either path), counts it and returns
# a new array, or None for anything else; the general path then runs and makes
# every check. The functions below only turn the engine's errors into
# keras_dist's.

_NO_COMPRESSION = Compression.none


def _one_call_transport(group):
    """The shm transport that serves ``group``'s one-call collectives: the
    job's shm transport under its join layer when the job is on one machine,
    else None."""
    transport = group.transport if group is not None else None
    inner = getattr(transport, "inner", None)
    if not (isinstance(transport, JoinableTransport) and isinstance(inner, ShmTransport)
            and inner.size == group.size):
        return None
    return inner


_native.dispatch_setup(vars(context), vars(timeline), _one_call_transport, COUNTERS,
                       (Average, _vocab.Sum, _vocab.Min, _vocab.Max, _vocab.Product))
_dispatch_allreduce = _native.dispatch_allreduce
_dispatch_broadcast = _native.dispatch_broadcast
_dispatch_allgather = _native.dispatch_allgather


def _allreduce_one_call_failed(native: BaseException, x: np.ndarray, op, name) -> np.ndarray:
    """The one-call allreduce's engine error ``native`` raised as keras_dist's,
    or, when ranks have joined, the result as the general path has it."""
    error = _translate(native)
    if type(error) is not CollectiveMismatchError:
        raise error from None
    op = op or Average
    described = _describe(f"{name or 'allreduce'} {op.value}", ((x.shape, x.dtype.str),), 1)
    result = context._group.transport.allreduce_mismatched(
        error, x.reshape(-1), _vocab.TRANSPORT_OPS[op], described).reshape(x.shape)
    _vocab.finish_reduction(result, op, context._group.size, 1.0)
    COUNTERS["allreduce"] += 1
    return result


def _broadcast_one_call_failed(native: BaseException, x: np.ndarray, root_rank, name):
    """Raises the one-call broadcast's engine error ``native`` as keras_dist's."""
    error = _translate(native)
    if type(error) is CollectiveMismatchError:
        context._group.transport.raise_mismatched(
            error, "broadcast", x.reshape(-1).view(np.uint8),
            _describe(name or "broadcast", ((x.shape, x.dtype.str),), 1), root_rank)
    raise error from None


def _allgather_one_call_failed(native: BaseException, name, transport=None):
    """Raises the one-call allgather's engine error ``native`` as keras_dist's
    (``transport``: the group's, default the job's)."""
    error = _translate(native)
    if type(error) is CollectiveMismatchError:  # at the records' step, the first
        (transport or context._group.transport).raise_mismatched(
            error, "allgather", np.zeros(_GATHER_RECORD, np.uint8),
            f"{name or 'allgather'} shapes")
    raise error from None


def _gather_kernel(names: list[str], group):
    """For ``conversions.run``: a traced TF step's allgathers of its inputs
    (input i named ``names[i]``) as keras_dist's own op (``tf_kernel``), or
    None where the group or the op library needs the numpy path."""
    from keras_dist.tensor import tf_kernel

    # In a group of one rank each rank's rows are the result: no op in the step.
    return _kernel_for(group, tf_kernel.gathered_alone,
                       lambda transport, engine: _gather_builder(transport, engine, names),
                       tf_kernel.enabled())


def _gather_builder(transport, engine, names: list[str]):
    """``_gather_kernel``'s builder on ``engine``."""
    from keras_dist.tensor import tf_kernel

    def build(tensors: list) -> list | None:
        if not tf_kernel.gathers() or any(
                t.shape.rank is None or t.shape.rank > _MAX_GATHER_NDIM for t in tensors):
            return None
        dtypes = [np.dtype(t.dtype.as_numpy_dtype) for t in tensors]

        def fallback(index: int, headers: bytes | None, error) -> tuple:
            try:
                if headers is not None:
                    raise _gather_mismatch(
                        np.frombuffer(headers, np.int64).reshape(-1, _GATHER_HEADER),
                        dtypes[index])
                _allgather_one_call_failed(error, names[index], transport)
            except Exception as failure:  # noqa: BLE001 - becomes the op's status
                return tf_kernel.status_of(failure, CollectiveMismatchError)
            raise AssertionError("unreachable: the allgather's error was not raised")

        def record(index: int, nbytes: int, start_ns: int, end_ns: int, wait_ns: int) -> None:
            timeline.record_collective(names[index], "allgather", nbytes, start_ns, end_ns,
                                       wait_ns, None)

        return tf_kernel.allgather(tensors, engine, names, dtypes, fallback, record)

    return build


# ---------------------------------------------------------------------------
# Public collectives. Each takes ``process_set`` (None: the whole job) and
# runs on that group: its ranks, its size (an Average divides by it), its
# transport.


@not_converted_by_autograph
def allreduce(x, op: ReduceOp | None = None, name: str | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              compression=Compression.none, average: bool | None = None, process_set=None):
    """Reduces ``x`` across the ranks of ``process_set``.

    Args:
        x: a numpy array, Python scalar, TF tensor (eager or symbolic), TF
            ``IndexedSlices``, Keras variable or cupy array.
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product`` or
            ``Adasum`` (floating dtypes, the whole job, a power-of-2 number of
            ranks; see ``keras_dist.tensor.adasum``). ``Average`` of integers
            rounds down.
        name: a label for the timeline.
        prescale_factor: multiplies ``x`` before the reduction.
        postscale_factor: multiplies the result. Integers are scaled in
            float64 and truncated toward zero, half precision in float32.
        compression: ``Compression.none`` or ``Compression.fp16``.
        average: legacy flag: True for ``Average``, False for ``Sum``; only
            when ``op`` is not given.
        process_set: the ranks to reduce over (default: every rank).

    Returns:
        The reduced value, of the same kind, dtype and shape as ``x``. An
        ``IndexedSlices`` comes back as the ``IndexedSlices`` of every rank's
        values and indices (``Sum`` or ``Average`` only, no scaling).

    Raises:
        CollectiveMismatchError: ranks passed different shapes or dtypes
            (also ``tf.errors.FailedPreconditionError`` for TF values).
    """
    if (process_set is None and average is None and compression is _NO_COMPRESSION
            and prescale_factor == 1.0 and postscale_factor == 1.0):
        try:
            result = _dispatch_allreduce(x, op, name)
        except _NATIVE_ERRORS as native:
            result = _allreduce_one_call_failed(native, x, op, name)
        if result is not None:
            return result
    return _allreduce(x, op, name, prescale_factor, postscale_factor, compression, average,
                      process_set)


@raising_tf_errors
def _allreduce(x, op, name, prescale_factor, postscale_factor, compression, average,
               process_set):
    """``allreduce``'s general path: every kind of value, every option."""
    op = _check_op(op, average)
    if type(x) is np.ndarray and compression is Compression.none and op is not _vocab.Adasum:
        return _allreduce_numpy(x, op, float(prescale_factor), float(postscale_factor),
                                name or "allreduce", context.group_for(process_set))
    return grouped_allreduce([x], op=op, name=name, prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor, compression=compression,
                             process_set=process_set)[0]


@raising_tf_errors
def grouped_allreduce(xs: Sequence, op: ReduceOp | None = None, name: str | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      compression=Compression.none, average: bool | None = None,
                      process_set=None) -> list:
    """Reduces every value of ``xs`` at once, fused by dtype.

    Every rank must pass the same number of values with the same shapes and
    dtypes, in the same order. Arguments as for ``allreduce``. Returns a list
    of the reduced values.
    """
    op = _check_op(op, average)
    group = context.group_for(process_set)
    if isinstance(xs, (str, bytes)) or not isinstance(xs, Sequence):
        raise TypeError(f"`xs` must be a list or tuple of tensors. Received: {type(xs)}")
    if not xs:
        return []
    prescale, postscale = float(prescale_factor), float(postscale_factor)
    sparse = [i for i, x in enumerate(xs) if is_indexed_slices(x)]
    if sparse:
        _check_sparse(op, prescale, postscale)
    dense = [i for i in range(len(xs)) if i not in set(sparse)]
    results: list = [None] * len(xs)
    done: list = []  # each collective runs after the previous one, in graphs too
    for i in sparse:
        with conversions.after(done):
            results[i] = _allreduce_sparse(xs[i], op, name, group, process_set)
        done = [results[i].indices]
    if dense:
        with conversions.after(done):
            reduced = _grouped_allreduce_dense([xs[i] for i in dense], op, name, prescale,
                                               postscale, compression, group, process_set)
        for i, result in zip(dense, reduced):
            results[i] = result
    return results


def grouped_allreduce_gradients(xs: Sequence, op: ReduceOp, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0, compression=Compression.none,
                                process_set=None) -> list:
    """``grouped_allreduce`` of an optimizer's own fresh gradients, which it may
    overwrite: contiguous CPU torch tensors are reduced in their own memory and
    returned (as Horovod's ``allreduce_``), so the update reads the memory the
    backward pass has just written; any other values (or tensors sharing
    memory) as ``grouped_allreduce``."""
    if (compression is not Compression.none or op is _vocab.Adasum or not xs
            or not all(conversions.is_torch(x) and x.device.type == "cpu"
                       and x.is_contiguous() for x in xs)
            or len({x.data_ptr() for x in xs if x.numel()}) < sum(1 for x in xs if x.numel())):
        return grouped_allreduce(xs, op=op, prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor, compression=compression,
                                 process_set=process_set)
    op = _check_op(op, None)
    group = context.group_for(process_set)
    arrays = [conversions.to_numpy(x) for x in xs]
    _check_allreduce_inputs([a.dtype for a in arrays])
    labels = timeline.current_names()
    prescale, postscale = float(prescale_factor), float(postscale_factor)
    _in_place(op, prescale, postscale, "allreduce", group, labels)(arrays)
    return list(xs)


def _grouped_allreduce_dense(xs: list, op: ReduceOp, name: str | None, prescale: float,
                             postscale: float, compression, group, process_set) -> list:
    on_gpu = [is_cupy(unwrap(x)) for x in xs]
    if any(on_gpu) and not all(on_gpu):
        raise TypeError(
            "`grouped_allreduce` takes cupy arrays only or host values only in one call. "
            f"Received: cupy arrays at positions {[i for i, g in enumerate(on_gpu) if g]} "
            f"and other values at {[i for i, g in enumerate(on_gpu) if not g]}"
        )
    _check_allreduce_inputs([dtype_of(x) for x in xs])
    reduce_arrays = _allreduce_arrays
    if op is _vocab.Adasum:
        adasum.check_inputs([dtype_of(x) for x in xs], group, on_gpu[0])
        reduce_arrays = functools.partial(adasum.allreduce_arrays, gather=_allgather_array)
    if on_gpu[0]:
        if group is not context.get():
            raise NotImplementedError(
                "`process_set` is not supported for cupy values yet. "
                f"Received: process_set={process_set!r}"
            )
        from keras_dist.tensor import gpu

        return gpu.grouped_allreduce(list(xs), op, prescale, postscale, compression, COUNTERS)
    compressed, contexts = zip(*(compression.compress(unwrap(x)) for x in xs))
    labels = timeline.current_names()  # read now: a traced step runs the call later
    results = run(
        compressed,
        lambda arrays: reduce_arrays(arrays, op, prescale, postscale,
                                     name or "allreduce", group, labels),
        "allreduce",
        grad=tf_ops.allreduce_grad(grouped_allreduce, op, prescale, postscale, process_set),
        device_fn=_device_allreduce(op, prescale, postscale, name, group, labels),
        in_place=(_in_place(op, prescale, postscale, name or "allreduce", group, labels)
                  if reduce_arrays is _allreduce_arrays else None),
        one_buffer=True,
        graph_kernel=_graph_kernel(op, prescale, postscale, name or "allreduce", group, labels,
                                   reduce_arrays),
        xla_kernel=_xla_kernel(op, prescale, postscale, name or "allreduce", group, labels,
                               reduce_arrays),
    )
    return [compression.decompress(r, c) for r, c in zip(results, contexts)]


def _in_place(op: ReduceOp, prescale: float, postscale: float, name: str, group,
              labels: list[str] | None):
    """The allreduce as ``conversions.run``'s ``in_place``: each result left
    in its array (a copy only where a group of one rank scales)."""
    def run_in_place(arrays: list[np.ndarray]) -> None:
        results = _allreduce_arrays(arrays, op, prescale, postscale, name, group, labels,
                                    arrays)
        for array, result in zip(arrays, results):
            if result is not array:
                np.copyto(array, result)

    return run_in_place


def _device_allreduce(op: ReduceOp, prescale: float, postscale: float, name: str | None,
                      group, labels: list[str] | None = None):
    """The allreduce on device arrays (``conversions.run``'s ``device_fn``): GPU
    tensors of the job's group reduced on the GPU data plane; None (the host
    path) for Adasum and process sets, which the GPU path does not serve."""
    if op is _vocab.Adasum or group is not context.get():
        return None
    from keras_dist.tensor import gpu

    return lambda arrays: gpu.grouped_allreduce(arrays, op, prescale, postscale,
                                                Compression.none, COUNTERS,
                                                name or "allreduce", group, labels)


def _check_sparse(op: ReduceOp, prescale: float, postscale: float) -> None:
    if op not in (Average, _vocab.Sum):
        raise NotImplementedError(
            "`allreduce` of `IndexedSlices` supports op=Sum and op=Average only. "
            f"Received: op={op}"
        )
    if prescale != 1.0 or postscale != 1.0:
        raise NotImplementedError(
            "`allreduce` of `IndexedSlices` does not scale. "
            f"Received: prescale_factor={prescale}, postscale_factor={postscale}"
        )


def _allreduce_sparse(x, op: ReduceOp, name: str | None, group, process_set):
    """An ``IndexedSlices`` reduced as Horovod does: every rank's rows, gathered."""
    values, indices = gather_rows(x.values, x.indices, name, process_set)
    return tf_ops.indexed_slices(values, indices, x.dense_shape,
                                 group.size if op is Average else None)


def gather_rows(values, indices, name: str | None = None, process_set=None) -> tuple:
    """A sparse gradient's ``values`` and ``indices`` from every rank of
    ``process_set``: two allgathers (named ``"<name> values"`` and ``"<name>
    indices"``, or ``"allgather"``), in one op of keras_dist's in a traced TF
    step where it serves the group (``tf_kernel``)."""
    names = [name and f"{name} values", name and f"{name} indices"]
    group = context.group_for(process_set)
    kernel = _gather_kernel([n or "allgather" for n in names], group)
    if kernel is None or not all(is_symbolic(v) for v in (values, indices)):
        gathered = allgather(values, name=names[0], process_set=process_set)
        with conversions.after([gathered]):
            return gathered, allgather(indices, name=names[1], process_set=process_set)
    _check_byte_dtypes([dtype_of(values), dtype_of(indices)], "allgather")
    return tuple(run(
        [values, indices],
        lambda arrays: [_allgather_array(a, n or "allgather", group)
                        for a, n in zip(arrays, names)],
        "allgather", shapes=lambda shapes: [[None, *s[1:]] for s in shapes],
        graph_kernel=kernel))


@not_converted_by_autograph
def allgather(x, name: str | None = None, process_set=None):
    """Concatenates ``x`` from every rank of ``process_set`` along the first
    dimension, in rank order.

    The first dimension may differ between ranks; the rest must match. A
    scalar counts as a vector of one element. Any fixed-size dtype (bool
    included) travels.

    Raises:
        CollectiveMismatchError: ranks passed different dtypes or shapes past
            the first dimension (also ``tf.errors.FailedPreconditionError``
            for TF values).
    """
    if process_set is None:
        try:
            result = _dispatch_allgather(x, name)
        except _NATIVE_ERRORS as native:
            _allgather_one_call_failed(native, name)
        if type(result) is np.ndarray:
            return result
        if result is not None:  # the ranks' headers: they disagree
            headers = np.frombuffer(result, np.int64).reshape(-1, _GATHER_HEADER)
            raise _gather_mismatch(headers, x.dtype)
    return _allgather(x, name, process_set)


@raising_tf_errors
def _allgather(x, name: str | None, process_set):
    """``allgather``'s general path."""
    group = context.group_for(process_set)
    _check_byte_dtypes([dtype_of(x)], "allgather")
    return run([x], lambda arrays: [_allgather_array(arrays[0], name or "allgather", group)],
               "allgather", shapes=lambda shapes: [[None, *shapes[0][1:]]],
               grad=tf_ops.allgather_grad(allgather, allreduce, process_set),
               graph_kernel=_gather_kernel([name or "allgather"], group))[0]


@not_converted_by_autograph
def broadcast(x, root_rank: int, name: str | None = None, process_set=None):
    """Returns ``root_rank``'s ``x`` on every rank of ``process_set``.

    Shapes and dtypes must match; ``root_rank`` is a job rank (a member of the set).
    """
    if process_set is None:
        try:
            result = _dispatch_broadcast(x, root_rank, name)
        except _NATIVE_ERRORS as native:
            _broadcast_one_call_failed(native, x, root_rank, name)
        if result is not None:
            return result
    return _broadcast(x, root_rank, name, process_set)


@raising_tf_errors
def _broadcast(x, root_rank: int, name: str | None, process_set):
    """``broadcast``'s general path."""
    group = context.group_for(process_set)
    root = _check_root(root_rank, group)
    _check_byte_dtypes([dtype_of(x)], "broadcast")
    return run([x], lambda arrays: _broadcast_arrays(arrays, root, name or "broadcast", group),
               "broadcast",
               grad=tf_ops.broadcast_grad(allreduce, root, group.rank, process_set))[0]


def _check_variables(variables) -> list:
    variables = list(variables)
    for index, variable in enumerate(variables):
        if not callable(getattr(variable, "assign", None)):
            raise TypeError(
                "`variables` must be Keras or TensorFlow variables. "
                f"Received: {type(variable).__name__} at position {index}"
            )
    return variables


@raising_tf_errors
def broadcast_(variables: Sequence, root_rank: int, name: str | None = None,
               process_set=None) -> list:
    """Assigns ``root_rank``'s values to ``variables`` in place and returns them.

    Works eagerly, in a ``tf.function`` and in a TF1 graph (where the
    returned values carry the assignments: evaluating them broadcasts).

    Returns:
        The variables' new values, one per variable.
    """
    return _broadcast_in_place(variables, root_rank, name or "broadcast_", process_set)


@raising_tf_errors
def broadcast_variables(variables: Sequence, root_rank: int = 0, process_set=None):
    """Assigns ``root_rank``'s values to ``variables`` (Keras or TF) on every rank.

    All variables travel in fused buckets, one transport call per dtype bucket.
    Works eagerly and inside a ``tf.function`` (one op for all variables,
    then the assignments).

    Returns:
        None; in a TF1 graph, the op that runs the broadcast.
    """
    values = _broadcast_in_place(variables, root_rank, "broadcast_variables", process_set)
    if values and not conversions.executing_eagerly():
        return conversions.group_op(values)
    return None


def _broadcast_in_place(variables: Sequence, root_rank: int, name: str, process_set) -> list:
    group = context.group_for(process_set)
    root = _check_root(root_rank, group)
    variables = _check_variables(variables)
    _check_byte_dtypes([dtype_of(v) for v in variables], name)
    if not variables:
        return []
    if group.size == 1:
        return conversions.assign_and_read(variables, None)
    values = run(variables, lambda arrays: _broadcast_arrays(arrays, root, name, group), name)
    return conversions.assign_and_read(variables, values)


def broadcast_object(obj, root_rank: int = 0, process_set=None):
    """Returns ``root_rank``'s picklable ``obj`` on every rank of ``process_set``."""
    group = context.group_for(process_set)
    root = _check_root(root_rank, group)
    # Pickled at every size: an object that cannot travel fails at one rank too.
    pickled = pickle.dumps(obj) if group.rank == root else None
    if group.size == 1:
        return obj
    payload = None if pickled is None else np.frombuffer(pickled, np.uint8)
    length = np.array([0 if payload is None else payload.size], np.int64)
    group.transport.broadcast(length, root, name="broadcast_object length")
    if payload is None:
        payload = np.empty(int(length[0]), np.uint8)
    else:
        payload = payload.copy()
    group.transport.broadcast(payload, root, name="broadcast_object")
    COUNTERS["broadcast_object"] += 1
    return obj if group.rank == root else pickle.loads(payload.tobytes())


def allgather_object(obj, process_set=None) -> list:
    """Returns the list of every rank's picklable ``obj``, in rank order."""
    group = context.group_for(process_set)
    pickled = pickle.dumps(obj)  # at every size, as for broadcast_object
    if group.size == 1:
        return [obj]
    payload = np.frombuffer(pickled, np.uint8)
    lengths = _allgather_array(np.array([payload.size], np.int64), "allgather_object lengths",
                               group)
    gathered = _allgather_array(payload, "allgather_object", group)
    COUNTERS["allgather_object"] += 1
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return [pickle.loads(gathered[offsets[r] : offsets[r + 1]].tobytes())
            for r in range(group.size)]


def barrier(process_set=None) -> None:
    """Returns once every rank of ``process_set`` has called ``barrier``."""
    group = context.group_for(process_set)
    group.transport.barrier()
    COUNTERS["barrier"] += 1
