"""The tensor layer: collectives on numpy, TF (eager and graph) and cupy values.

Every public collective takes a value of one of those kinds and returns the
same kind, dtype and shape; the input is never modified. Underneath, values
become flat numpy buffers handed to the process group's transport, grouped
by dtype into fused buckets (``fusion.py``).
"""

from __future__ import annotations

import collections
import functools
import pickle
from collections.abc import Sequence

import numpy as np

from keras_dist import _vocab
from keras_dist._runtime import context, timeline
from keras_dist._vocab import Average, ReduceOp
from keras_dist.tensor import fusion, outputs
from keras_dist.tensor.compression import Compression
from keras_dist.tensor.conversions import dtype_of, is_cupy, run, unwrap

#: Transport calls made by this process, by collective ("allreduce", ...).
#: One fused bucket is one call. Tests count collectives with it.
COUNTERS: collections.Counter = collections.Counter()


# ---------------------------------------------------------------------------
# Argument checks. Every collective makes them before anything else, at any
# size (a call that fails at 2 ranks fails the same way at 1).


def _check_op(op) -> ReduceOp:
    if not isinstance(op, ReduceOp):
        raise ValueError(
            "`op` must be one of keras_dist.Average, Sum, Min, Max, Product. "
            f"Received: op={op!r}"
        )
    return op


def _check_root(root_rank, size: int) -> int:
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)):
        raise ValueError(f"`root_rank` must be an integer. Received: root_rank={root_rank!r}")
    if not 0 <= root_rank < size:
        raise ValueError(
            f"`root_rank` must be in [0, size). Received: root_rank={root_rank} (size={size})"
        )
    return int(root_rank)


def _check_dtypes(dtypes: Sequence[np.dtype], collective: str) -> None:
    for dtype in dtypes:
        if not _vocab.is_supported(dtype):
            raise TypeError(
                f"`{collective}` supports {_vocab.SUPPORTED_DTYPE_NAMES}. "
                f"Received: dtype={np.dtype(dtype).name}"
            )


def _check_broadcast_dtypes(dtypes: Sequence[np.dtype], collective: str) -> None:
    """Broadcasts move bytes: any fixed-size number or bool travels unchanged."""
    for dtype in dtypes:
        if not (_vocab.is_supported(dtype) or np.dtype(dtype).kind in "biufc"):
            raise TypeError(
                f"`{collective}` supports booleans and numbers. "
                f"Received: dtype={np.dtype(dtype).name}"
            )


# ---------------------------------------------------------------------------
# Numpy cores: flat buffers through the transport.


def _check_allreduce_inputs(dtypes: Sequence[np.dtype], prescale: float,
                            postscale: float) -> None:
    _check_dtypes(dtypes, "allreduce")
    if prescale == 1.0 and postscale == 1.0:
        return
    for dtype in dtypes:
        if not _vocab.is_float(dtype):
            raise TypeError(
                "`prescale_factor` and `postscale_factor` apply to floating-point values only. "
                f"Received: dtype={np.dtype(dtype).name}, prescale_factor={prescale}, "
                f"postscale_factor={postscale}"
            )


def _allreduce_numpy(x: np.ndarray, op: ReduceOp, prescale: float, postscale: float,
                     name: str) -> np.ndarray:
    """``allreduce`` of one numpy array: reduced in its fresh output, no fusion."""
    group = context.get()
    _check_allreduce_inputs([x.dtype], prescale, postscale)
    if group.size == 1:
        return x if prescale * postscale == 1.0 else x * (prescale * postscale)
    out = outputs.POOL.empty(x.shape, x.dtype)
    send = None  # the transport reads ``x`` itself: no copy into ``out`` first
    if prescale != 1.0:
        np.multiply(x, prescale, out=out, casting="unsafe")
    elif x.flags.c_contiguous:
        send = x.reshape(-1)
    else:
        np.copyto(out, x)
    if out.size:
        with timeline.activity(name, "allreduce", out.nbytes):
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


def _allreduce_arrays(arrays: list[np.ndarray], op: ReduceOp, prescale: float,
                      postscale: float, name: str) -> list[np.ndarray]:
    group = context.get()
    _check_allreduce_inputs([a.dtype for a in arrays], prescale, postscale)
    if group.size == 1:
        if prescale * postscale == 1.0:
            return arrays
        return [a * (prescale * postscale) for a in arrays]
    transport = group.transport
    code = _vocab.TRANSPORT_OPS[op]
    outputs: list[np.ndarray | None] = list(arrays)  # empty arrays pass through
    with timeline.activity(name, "allreduce", sum(a.nbytes for a in arrays)):
        for bucket in fusion.plan_buckets(arrays, group.config.fusion_threshold_bytes):
            members = [arrays[i] for i in bucket]
            dtype = members[0].dtype
            count = sum(a.size for a in members)
            flat = transport.scratch(count * dtype.itemsize).view(dtype)
            fusion.pack(members, flat, prescale)
            transport.allreduce(flat, code, name=_describe(
                f"{name} {op.value}", tuple((a.shape, a.dtype.str) for a in members),
                len(arrays)))
            COUNTERS["allreduce"] += 1
            # ``flat`` may be shared memory that peers still read: only read it now.
            scale = _vocab.finishing_scale(op, dtype, group.size, postscale)
            results = fusion.unpack(flat, members, 1.0 if scale is None else scale)
            if scale is None:
                for result in results:
                    np.floor_divide(result, group.size, out=result)
            for index, result in zip(bucket, results):
                outputs[index] = result
    return outputs


def _broadcast_arrays(arrays: list[np.ndarray], root: int, name: str) -> list[np.ndarray]:
    group = context.get()
    if group.size == 1:
        return arrays
    outputs = [np.array(a, copy=True) for a in arrays]
    with timeline.activity(name, "broadcast", sum(a.nbytes for a in arrays)):
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


def _allgather_array(array: np.ndarray, name: str) -> np.ndarray:
    group = context.get()
    array = np.ascontiguousarray(array)
    if array.ndim == 0:
        array = array.reshape(1)
    _check_dtypes([array.dtype], "allgather")
    if array.ndim > _MAX_GATHER_NDIM:
        raise ValueError(f"`allgather` takes at most {_MAX_GATHER_NDIM} dimensions. "
                         f"Received: shape={array.shape}")
    if group.size == 1:
        return array.copy()
    # Shapes first: ranks may differ in the first dimension only.
    header = np.zeros(2 + _MAX_GATHER_NDIM, np.int64)
    header[:2] = array.ndim, _vocab.dtype_code(array.dtype)
    header[2 : 2 + array.ndim] = array.shape
    headers = np.empty(header.size * group.size, np.int64)
    group.transport.allgatherv(header, headers, [header.size] * group.size,
                               name=f"{name} shapes")
    headers = headers.reshape(group.size, -1)
    shapes = [tuple(int(d) for d in h[2 : 2 + h[0]]) for h in headers]
    if any((h[0], h[1]) != (headers[0][0], headers[0][1]) or shape[1:] != shapes[0][1:]
           for h, shape in zip(headers, shapes)):
        names = _vocab.DTYPE_NAMES
        detail = ", ".join(f"rank {r}: shape={shape} dtype={names.get(int(h[1]), h[1])}"
                           for r, (h, shape) in enumerate(zip(headers, shapes)))
        raise ValueError(
            "`allgather` needs the same dtype and the same shape past the first "
            f"dimension on every rank. Received: {detail}"
        )
    counts = [int(np.prod(shape)) for shape in shapes]
    out = outputs.POOL.empty((sum(shape[0] for shape in shapes), *array.shape[1:]), array.dtype)
    with timeline.activity(name, "allgather", out.nbytes):
        group.transport.allgatherv(array.reshape(-1), out.reshape(-1), counts, name=name)
    COUNTERS["allgather"] += 1
    return out


# ---------------------------------------------------------------------------
# Public collectives.


def allreduce(x, op: ReduceOp = Average, name: str | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, compression=Compression.none):
    """Reduces ``x`` across all ranks.

    Args:
        x: a numpy array, Python scalar, TF tensor (eager or symbolic), Keras
            variable or cupy array.
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
            ``Average`` of integers rounds down.
        name: a label for the timeline.
        prescale_factor: multiplies ``x`` before the reduction (floats only).
        postscale_factor: multiplies the result (floats only).
        compression: ``Compression.none`` or ``Compression.fp16``.

    Returns:
        The reduced value, of the same kind, dtype and shape as ``x``.
    """
    if type(x) is np.ndarray and compression is Compression.none:
        return _allreduce_numpy(x, _check_op(op), float(prescale_factor),
                                float(postscale_factor), name or "allreduce")
    return grouped_allreduce([x], op=op, name=name, prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor, compression=compression)[0]


def grouped_allreduce(xs: Sequence, op: ReduceOp = Average, name: str | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      compression=Compression.none) -> list:
    """Reduces every value of ``xs`` at once, fused by dtype.

    Every rank must pass the same number of values with the same shapes and
    dtypes, in the same order. Returns a list of the reduced values.
    """
    op = _check_op(op)
    context.get()
    if isinstance(xs, (str, bytes)) or not isinstance(xs, Sequence):
        raise TypeError(f"`xs` must be a list or tuple of tensors. Received: {type(xs)}")
    if not xs:
        return []
    on_gpu = [is_cupy(unwrap(x)) for x in xs]
    if any(on_gpu) and not all(on_gpu):
        raise TypeError(
            "`grouped_allreduce` takes cupy arrays only or host values only in one call. "
            f"Received: cupy arrays at positions {[i for i, g in enumerate(on_gpu) if g]} "
            f"and other values at {[i for i, g in enumerate(on_gpu) if not g]}"
        )
    _check_allreduce_inputs([dtype_of(x) for x in xs], float(prescale_factor),
                            float(postscale_factor))
    if on_gpu[0]:
        from keras_dist.tensor import gpu

        return gpu.grouped_allreduce(list(xs), op, float(prescale_factor),
                                     float(postscale_factor), compression, COUNTERS)
    compressed, contexts = zip(*(compression.compress(unwrap(x)) for x in xs))
    results = run(
        compressed,
        lambda arrays: _allreduce_arrays(arrays, op, float(prescale_factor),
                                         float(postscale_factor), name or "allreduce"),
        "allreduce",
    )
    return [compression.decompress(r, c) for r, c in zip(results, contexts)]


def allgather(x, name: str | None = None):
    """Concatenates ``x`` from every rank along the first dimension, in rank order.

    The first dimension may differ between ranks; the rest must match. A
    scalar counts as a vector of one element.
    """
    context.get()
    _check_dtypes([dtype_of(x)], "allgather")
    return run([x], lambda arrays: [_allgather_array(arrays[0], name or "allgather")],
                "allgather", shapes=lambda s: [None, *s[1:]])[0]


def broadcast(x, root_rank: int, name: str | None = None):
    """Returns ``root_rank``'s ``x`` on every rank. Shapes and dtypes must match."""
    group = context.get()
    root = _check_root(root_rank, group.size)
    _check_broadcast_dtypes([dtype_of(x)], "broadcast")
    return run([x], lambda arrays: _broadcast_arrays(arrays, root, name or "broadcast"),
                "broadcast")[0]


def broadcast_variables(variables: Sequence, root_rank: int = 0) -> None:
    """Assigns ``root_rank``'s values to ``variables`` (Keras or TF) on every rank.

    All variables travel in fused buckets, one transport call per dtype bucket.
    Works eagerly and inside a ``tf.function`` (one op for all variables,
    then the assignments).
    """
    group = context.get()
    root = _check_root(root_rank, group.size)
    variables = list(variables)
    for index, variable in enumerate(variables):
        if not callable(getattr(variable, "assign", None)):
            raise TypeError(
                "`variables` must be Keras or TensorFlow variables. "
                f"Received: {type(variable).__name__} at position {index}"
            )
    _check_broadcast_dtypes([dtype_of(v) for v in variables], "broadcast_variables")
    if group.size == 1 or not variables:
        return
    values = run(variables, lambda arrays: _broadcast_arrays(arrays, root, "broadcast_variables"),
                 "broadcast_variables")
    for variable, value in zip(variables, values):
        variable.assign(value)


def broadcast_object(obj, root_rank: int = 0):
    """Returns ``root_rank``'s picklable ``obj`` on every rank."""
    group = context.get()
    root = _check_root(root_rank, group.size)
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


def allgather_object(obj) -> list:
    """Returns the list of every rank's picklable ``obj``, in rank order."""
    group = context.get()
    pickled = pickle.dumps(obj)  # at every size, as for broadcast_object
    if group.size == 1:
        return [obj]
    payload = np.frombuffer(pickled, np.uint8)
    lengths = _allgather_array(np.array([payload.size], np.int64), "allgather_object lengths")
    gathered = _allgather_array(payload, "allgather_object")
    COUNTERS["allgather_object"] += 1
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return [pickle.loads(gathered[offsets[r] : offsets[r + 1]].tobytes())
            for r in range(group.size)]


def barrier() -> None:
    """Returns once every rank has called ``barrier``."""
    group = context.get()
    group.transport.barrier()
    COUNTERS["barrier"] += 1
