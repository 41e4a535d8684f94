"""The tensor layer: collectives on numpy, TF (eager and graph) and cupy values.

Every public collective takes a value of one of those kinds and returns the
same kind, dtype and shape; the input is never modified. Underneath, values
become flat numpy buffers handed to the process group's transport, grouped
by dtype into fused buckets (``fusion.py``).

This module holds the public collectives and their numpy cores; beside it:
the argument checks (``checks``), the allreduce plans (``allreduce_plans``),
the allgather record (``gather_records``), the one-call native paths
(``one_call``) and the native kernels of traced steps (``native_kernels``).
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Sequence

import numpy as np

from keras_dist import _vocab
from keras_dist._runtime import context, timeline
from keras_dist._vocab import Average, ReduceOp
from keras_dist.tensor import (
    adasum,
    allreduce_plans,
    checks,
    conversions,
    fusion,
    gather_records,
    kinds,
    native_kernels,
    one_call,
    outputs,
)
from keras_dist.tensor.collective import Collective
from keras_dist.tensor.compression import Compression
from keras_dist.tensor.conversions import run
from keras_dist.tensor.counters import COUNTERS
from keras_dist.tensor.kinds import dtype_of, is_cupy, is_indexed_slices, is_symbolic, unwrap
from keras_dist.tensor.tf import ops as tf_ops
from keras_dist.tensor.tf.errors import not_converted_by_autograph, raising_tf_errors

# ---------------------------------------------------------------------------
# Numpy cores: flat buffers through the transport.


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
    checks.check_allreduce_inputs([x.dtype])
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
            described = allreduce_plans.describe(f"{name} {op.value}",
                                                 ((x.shape, x.dtype.str),), 1)
            group.transport.allreduce(out.reshape(-1), _vocab.TRANSPORT_OPS[op],
                                      name=described, send=send)
        COUNTERS["allreduce"] += 1
    _vocab.finish_reduction(out, op, group.size, postscale)
    return out


def allreduce_arrays(arrays: list[np.ndarray], op: ReduceOp, prescale: float,
                      postscale: float, name: str, group=None,
                      labels: list[str] | None = None,
                      results: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """The allreduce of ``arrays``: new arrays, or ``results`` (arrays of the
    same shapes and dtypes, ``arrays`` themselves for one in place) filled."""
    group = group or context.get()
    if group.size == 1:
        checks.check_allreduce_inputs([a.dtype for a in arrays])
        if prescale == 1.0 and postscale == 1.0:
            return arrays
        return [_allreduce_numpy(a, op, prescale, postscale, name, group) for a in arrays]
    transport = group.transport
    buckets, offsets, total, nbytes = allreduce_plans.allreduce_plan(
        arrays, op, name, group.config.fusion_threshold_bytes)
    # Every result is a view of one aligned buffer, in the order of `arrays`:
    # one allocation, and no copy when a traced TensorFlow step takes them
    # (as that buffer, `tf.graph_buffer`) from tf.numpy_function.
    outputs = results if results is not None else fusion.aligned_views(arrays, offsets, total)
    # A transport that reduces parts (shm) reduces a bucket from the arrays
    # straight into the results, without a fused buffer, when nothing is
    # scaled but an Average.
    reduce_parts = prescale == 1.0 and postscale == 1.0 and transport.reduces_parts
    with timeline.activity(name, "allreduce", nbytes, transport, labels):
        for bucket, _, described in buckets:
            if len(bucket) == len(arrays):  # one bucket: every array
                members, results = arrays, outputs
            else:
                members = [arrays[i] for i in bucket]
                results = [outputs[i] for i in bucket]
            if reduce_parts:
                allreduce_plans.allreduce_parts(transport, members, results, op, described,
                                                group.size)
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
    allreduce_plans.unpack_finished(flat, members, results, op, size, postscale)


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
            group.transport.broadcast(flat.view(np.uint8), root, name=allreduce_plans.describe(
                name, tuple((a.shape, a.dtype.str) for a in members), len(arrays)))
            COUNTERS["broadcast"] += 1
            if len(members) > 1:
                for index, result in zip(bucket, fusion.unpack(flat, members)):
                    outputs[index] = result
    return outputs


def _allgather_array(array: np.ndarray, name: str, group=None) -> np.ndarray:
    group = group or context.get()
    array = np.ascontiguousarray(array)
    if array.ndim == 0:
        array = array.reshape(1)
    checks.check_byte_dtypes([array.dtype], "allgather")
    if array.ndim > gather_records.MAX_NDIM:
        raise ValueError(f"`allgather` takes at most {gather_records.MAX_NDIM} dimensions. "
                         f"Received: shape={array.shape}")
    if group.size == 1:
        return array.copy()
    # Shapes first (ranks may differ in the first dimension only), with the
    # data of small arrays in the same records.
    record = gather_records.record_of(array)
    inline = gather_records.is_inline(record)
    records = np.empty((group.size, gather_records.RECORD_BYTES), np.uint8)
    # On the timeline: this step is the allgather itself for a rank whose data it carries.
    step = name if inline else f"{name} shapes"
    with timeline.activity(step, "allgather", records.nbytes, group.transport):
        group.transport.allgather_records(record, records.reshape(-1), name=f"{name} shapes")
    headers = gather_records.headers_of(records)
    shapes = gather_records.shapes_of(headers)
    if any((h[0], h[1]) != (headers[0][0], headers[0][1]) or shape[1:] != shapes[0][1:]
           for h, shape in zip(headers, shapes)):
        raise gather_records.mismatch_error(headers, array.dtype)
    row_bytes = int(np.prod(array.shape[1:], dtype=np.int64)) * array.dtype.itemsize
    counts = [shape[0] * row_bytes for shape in shapes]
    out = outputs.POOL.empty((sum(shape[0] for shape in shapes), *array.shape[1:]), array.dtype)
    flat = out.reshape(-1).view(np.uint8)
    if all(gather_records.is_inline(r) for r in records):
        start = 0
        for record, count in zip(records, counts):
            flat[start : start + count] = gather_records.data_of(record)[:count]
            start += count
    else:
        with timeline.activity(name, "allgather", out.nbytes, group.transport):
            group.transport.allgatherv(array.reshape(-1).view(np.uint8), flat, counts, name=name)
    COUNTERS["allgather"] += 1
    return out


_NO_COMPRESSION = Compression.none
# The one-call paths (``one_call``), looked up once.
_dispatch_allreduce = one_call.dispatch_allreduce
_dispatch_broadcast = one_call.dispatch_broadcast
_dispatch_allgather = one_call.dispatch_allgather


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
        except one_call.EngineError as native:
            result = one_call.allreduce_failed(native, x, op, name)
        if result is not None:
            return result
    return _allreduce(x, op, name, prescale_factor, postscale_factor, compression, average,
                      process_set)


@raising_tf_errors
def _allreduce(x, op, name, prescale_factor, postscale_factor, compression, average,
               process_set):
    """``allreduce``'s general path: every kind of value, every option."""
    op = checks.check_op(op, average)
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
    op = checks.check_op(op, average)
    group = context.group_for(process_set)
    if isinstance(xs, (str, bytes)) or not isinstance(xs, Sequence):
        raise TypeError(f"`xs` must be a list or tuple of tensors. Received: {type(xs)}")
    if not xs:
        return []
    prescale, postscale = float(prescale_factor), float(postscale_factor)
    sparse = [i for i, x in enumerate(xs) if is_indexed_slices(x)]
    if sparse:
        checks.check_sparse(op, prescale, postscale)
    dense = [i for i in range(len(xs)) if i not in set(sparse)]
    results: list = [None] * len(xs)
    done: list = []  # each collective runs after the previous one, in graphs too
    for i in sparse:
        with kinds.after(done):
            results[i] = _allreduce_sparse(xs[i], op, name, group, process_set)
        done = [results[i].indices]
    if dense:
        with kinds.after(done):
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
            or not all(kinds.is_torch(x) and x.device.type == "cpu"
                       and x.is_contiguous() for x in xs)
            or len({x.data_ptr() for x in xs if x.numel()}) < sum(1 for x in xs if x.numel())):
        return grouped_allreduce(xs, op=op, prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor, compression=compression,
                                 process_set=process_set)
    op = checks.check_op(op, None)
    group = context.group_for(process_set)
    arrays = [kinds.to_numpy(x) for x in xs]
    checks.check_allreduce_inputs([a.dtype for a in arrays])
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
    checks.check_allreduce_inputs([dtype_of(x) for x in xs])
    reduce_arrays = allreduce_arrays
    plain = op is not _vocab.Adasum  # Adasum reduces otherwise: no native kernel
    if not plain:
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
    results = run(compressed, Collective(
        lambda arrays: reduce_arrays(arrays, op, prescale, postscale,
                                     name or "allreduce", group, labels),
        "allreduce",
        grad=tf_ops.allreduce_grad(grouped_allreduce, op, prescale, postscale, process_set),
        device_fn=_device_allreduce(op, prescale, postscale, name, group, labels),
        in_place=(_in_place(op, prescale, postscale, name or "allreduce", group, labels)
                  if plain else None),
        one_buffer=True,
        graph_kernel=native_kernels.graph_kernel(op, prescale, postscale, name or "allreduce",
                                                 group, labels, plain),
        xla_kernel=native_kernels.xla_kernel(op, prescale, postscale, name or "allreduce",
                                             group, labels, plain),
    ))
    return [compression.decompress(r, c) for r, c in zip(results, contexts)]


def _in_place(op: ReduceOp, prescale: float, postscale: float, name: str, group,
              labels: list[str] | None):
    """The allreduce as a ``collective.Collective``'s ``in_place``: each result left
    in its array (a copy only where a group of one rank scales)."""
    def run_in_place(arrays: list[np.ndarray]) -> None:
        results = allreduce_arrays(arrays, op, prescale, postscale, name, group, labels,
                                    arrays)
        for array, result in zip(arrays, results):
            if result is not array:
                np.copyto(array, result)

    return run_in_place


def _device_allreduce(op: ReduceOp, prescale: float, postscale: float, name: str | None,
                      group, labels: list[str] | None = None):
    """The allreduce on device arrays (a ``collective.Collective``'s ``device_fn``): GPU
    tensors of the job's group reduced on the GPU data plane; None (the host
    path) for Adasum and process sets, which the GPU path does not serve."""
    if op is _vocab.Adasum or group is not context.get():
        return None
    from keras_dist.tensor import gpu

    return lambda arrays: gpu.grouped_allreduce(arrays, op, prescale, postscale,
                                                Compression.none, COUNTERS,
                                                name or "allreduce", group, labels)


def _allreduce_sparse(x, op: ReduceOp, name: str | None, group, process_set):
    """An ``IndexedSlices`` reduced as Horovod does: every rank's rows, gathered."""
    values, indices = gather_rows(x.values, x.indices, name, process_set)
    return tf_ops.indexed_slices(values, indices, x.dense_shape,
                                 group.size if op is Average else None)


def gather_rows(values, indices, name: str | None = None, process_set=None) -> tuple:
    """A sparse gradient's ``values`` and ``indices`` from every rank of
    ``process_set``: two allgathers (named ``"<name> values"`` and ``"<name>
    indices"``, or ``"allgather"``), in one op of keras_dist's in a traced TF
    step where it serves the group (``tf.kernel``)."""
    names = [name and f"{name} values", name and f"{name} indices"]
    group = context.group_for(process_set)
    kernel = native_kernels.gather_kernel([n or "allgather" for n in names], group)
    if kernel is None or not all(is_symbolic(v) for v in (values, indices)):
        gathered = allgather(values, name=names[0], process_set=process_set)
        with kinds.after([gathered]):
            return gathered, allgather(indices, name=names[1], process_set=process_set)
    checks.check_byte_dtypes([dtype_of(values), dtype_of(indices)], "allgather")
    return tuple(run([values, indices], Collective(
        lambda arrays: [_allgather_array(a, n or "allgather", group)
                        for a, n in zip(arrays, names)],
        "allgather", shapes=lambda shapes: [[None, *s[1:]] for s in shapes],
        graph_kernel=kernel)))


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
        except one_call.EngineError as native:
            one_call.allgather_failed(native, name)
        if type(result) is np.ndarray:
            return result
        if result is not None:  # the ranks' headers: they disagree
            headers = np.frombuffer(result, np.int64).reshape(-1, gather_records.HEADER_WORDS)
            raise gather_records.mismatch_error(headers, x.dtype)
    return _allgather(x, name, process_set)


@raising_tf_errors
def _allgather(x, name: str | None, process_set):
    """``allgather``'s general path."""
    group = context.group_for(process_set)
    checks.check_byte_dtypes([dtype_of(x)], "allgather")
    return run([x], Collective(
        lambda arrays: [_allgather_array(arrays[0], name or "allgather", group)],
        "allgather", shapes=lambda shapes: [[None, *shapes[0][1:]]],
        grad=tf_ops.allgather_grad(allgather, allreduce, process_set),
        graph_kernel=native_kernels.gather_kernel([name or "allgather"], group)))[0]


@not_converted_by_autograph
def broadcast(x, root_rank: int, name: str | None = None, process_set=None):
    """Returns ``root_rank``'s ``x`` on every rank of ``process_set``.

    Shapes and dtypes must match; ``root_rank`` is a job rank (a member of the set).
    """
    if process_set is None:
        try:
            result = _dispatch_broadcast(x, root_rank, name)
        except one_call.EngineError as native:
            one_call.broadcast_failed(native, x, root_rank, name)
        if result is not None:
            return result
    return _broadcast(x, root_rank, name, process_set)


@raising_tf_errors
def _broadcast(x, root_rank: int, name: str | None, process_set):
    """``broadcast``'s general path."""
    group = context.group_for(process_set)
    root = checks.check_root(root_rank, group)
    checks.check_byte_dtypes([dtype_of(x)], "broadcast")
    return run([x], Collective(
        lambda arrays: _broadcast_arrays(arrays, root, name or "broadcast", group),
        "broadcast",
        grad=tf_ops.broadcast_grad(allreduce, root, group.rank, process_set)))[0]


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
        None; in a TF1 graph, the op that runs the broadcast, for a
        ``session.run`` of its own: it is not ordered after the graph's other
        collectives, nor they after it.
    """
    if kinds.executing_eagerly():
        _broadcast_in_place(variables, root_rank, "broadcast_variables", process_set)
        return None
    with conversions.in_a_run_of_their_own():
        values = _broadcast_in_place(variables, root_rank, "broadcast_variables", process_set)
    return kinds.group_op(values) if values else None


def _broadcast_in_place(variables: Sequence, root_rank: int, name: str, process_set) -> list:
    group = context.group_for(process_set)
    root = checks.check_root(root_rank, group)
    variables = checks.check_variables(variables)
    checks.check_byte_dtypes([dtype_of(v) for v in variables], name)
    if not variables:
        return []
    if group.size == 1:
        return kinds.assign_and_read(variables, None)
    values = run(variables, Collective(
        lambda arrays: _broadcast_arrays(arrays, root, name, group), name))
    return kinds.assign_and_read(variables, values)


def broadcast_object(obj, root_rank: int = 0, process_set=None):
    """Returns ``root_rank``'s picklable ``obj`` on every rank of ``process_set``."""
    group = context.group_for(process_set)
    root = checks.check_root(root_rank, group)
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
