"""The tensor layer: collectives on numpy, TF (eager and graph) and cupy values.

Every public collective takes a value of one of those kinds and returns the
same kind, dtype and shape; the input is never modified. Underneath, values
become flat numpy buffers handed to the process group's transport, grouped
by dtype into fused buckets (``fusion.py``).
"""

from __future__ import annotations

import collections
import enum
import functools
import pickle
from collections.abc import Callable, Sequence

import numpy as np

from keras_dist import _context, _dtypes, _outputs, fusion, timeline

#: Transport calls made by this process, by collective ("allreduce", ...).
#: One fused bucket is one call. Tests count collectives with it.
COUNTERS: collections.Counter = collections.Counter()


class ReduceOp(enum.Enum):
    """How ``allreduce`` combines the ranks' values."""

    AVERAGE = "average"
    SUM = "sum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

_TRANSPORT_OPS = {
    ReduceOp.AVERAGE: _dtypes.SUM,
    ReduceOp.SUM: _dtypes.SUM,
    ReduceOp.MIN: _dtypes.MIN,
    ReduceOp.MAX: _dtypes.MAX,
    ReduceOp.PRODUCT: _dtypes.PRODUCT,
}


class _NoCompression:
    """Sends values as they are."""

    @staticmethod
    def compress(value):
        return value, None

    @staticmethod
    def decompress(value, ctx):
        return value


class _FP16Compression:
    """Sends floating-point values as float16 and restores their dtype after."""

    @staticmethod
    def compress(value):
        dtype = _dtype_of(value)
        if not np.issubdtype(dtype, np.floating) or dtype == np.float16:
            return value, None
        return _cast(value, np.float16), dtype

    @staticmethod
    def decompress(value, ctx):
        return value if ctx is None else _cast(value, ctx)


class Compression:
    """Gradient compression choices: ``Compression.none`` and ``Compression.fp16``."""

    none = _NoCompression
    fp16 = _FP16Compression


# ---------------------------------------------------------------------------
# Conversions between user values and numpy.


def _is_tf(value) -> bool:
    return type(value).__module__.startswith("tensorflow")


def _is_cupy(value) -> bool:
    return type(value).__module__.startswith("cupy")


def _unwrap(value):
    """A Keras variable becomes its backend value; anything else is returned."""
    if type(value).__module__.startswith("keras") and hasattr(value, "value"):
        return value.value
    return value


def _dtype_of(value) -> np.dtype:
    value = _unwrap(value)
    if _is_tf(value):
        return np.dtype(value.dtype.as_numpy_dtype)
    if hasattr(value, "dtype"):
        return np.dtype(value.dtype)
    return np.asarray(value).dtype


def _cast(value, dtype):
    value = _unwrap(value)
    if _is_tf(value):
        import tensorflow as tf

        return tf.cast(value, tf.as_dtype(dtype))
    if _is_cupy(value):
        return value.astype(dtype)
    return np.asarray(value).astype(dtype)


def _is_symbolic(value) -> bool:
    if not _is_tf(value):
        return False
    import tensorflow as tf

    return not tf.executing_eagerly() or not hasattr(value, "numpy")


def _to_numpy(value) -> np.ndarray:
    value = _unwrap(value)
    if _is_tf(value):
        return value.numpy()
    if _is_cupy(value):
        return value.get()
    array = np.asarray(value)
    if array.dtype == object:
        raise TypeError(
            f"keras_dist collectives take numbers, arrays or tensors. Received: {type(value)}"
        )
    return array


def _like(template, array: np.ndarray):
    """Returns ``array`` as the kind of value ``template`` is."""
    template = _unwrap(template)
    if _is_tf(template):
        import tensorflow as tf

        with tf.device(template.device or "/CPU:0"):
            return tf.convert_to_tensor(array)
    if _is_cupy(template):
        import cupy

        return cupy.asarray(array)
    if isinstance(template, np.ndarray):
        return array
    if np.ndim(template) == 0 and not isinstance(template, np.generic):
        return array.item()  # a Python scalar in, a Python scalar out
    return array[()] if array.ndim == 0 else array


def _run(values: Sequence, numpy_fn: Callable[[list[np.ndarray]], list[np.ndarray]],
         name: str, shapes: Callable | None = None) -> list:
    """Applies ``numpy_fn`` to ``values``, in a TF graph when they are symbolic.

    Eager values are converted to numpy and back. Symbolic TF values (inside a
    ``tf.function``) get one stateful ``tf.numpy_function`` op for the whole
    list, so the collective runs once per step, in program order.
    """
    values = [_unwrap(v) for v in values]
    if any(_is_symbolic(v) for v in values):
        import tensorflow as tf

        tensors = [tf.convert_to_tensor(v) for v in values]
        outputs = tf.numpy_function(
            lambda *arrays: numpy_fn(list(arrays)),
            tensors,
            Tout=[t.dtype for t in tensors],
            stateful=True,
            name=f"keras_dist_{name}",
        )
        for tensor, output in zip(tensors, outputs):
            output.set_shape(shapes(tensor.shape) if shapes else tensor.shape)
        return list(outputs)
    arrays = numpy_fn([_to_numpy(v) for v in values])
    return [_like(v, a) for v, a in zip(values, arrays)]


# ---------------------------------------------------------------------------
# Argument checks.


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


def _check_dtypes(arrays: Sequence[np.ndarray], collective: str) -> None:
    for array in arrays:
        if not _dtypes.is_supported(array.dtype):
            raise TypeError(
                f"`{collective}` supports {_dtypes.SUPPORTED_DTYPE_NAMES}. "
                f"Received: dtype={array.dtype.name}"
            )


# ---------------------------------------------------------------------------
# Numpy cores: flat buffers through the transport.


@functools.lru_cache(maxsize=64)
def _is_float(dtype: np.dtype) -> bool:
    return np.issubdtype(dtype, np.floating) or _dtypes.is_half(dtype)


def _check_allreduce_inputs(arrays: Sequence[np.ndarray], prescale: float,
                            postscale: float) -> None:
    _check_dtypes(arrays, "allreduce")
    if prescale == 1.0 and postscale == 1.0:
        return
    for array in arrays:
        if not _is_float(array.dtype):
            raise TypeError(
                "`prescale_factor` and `postscale_factor` apply to floating-point values only. "
                f"Received: dtype={array.dtype.name}, prescale_factor={prescale}, "
                f"postscale_factor={postscale}"
            )


def _allreduce_numpy(x: np.ndarray, op: ReduceOp, prescale: float, postscale: float,
                     name: str) -> np.ndarray:
    """``allreduce`` of one numpy array: reduced in its fresh output, no fusion."""
    group = _context.get()
    _check_allreduce_inputs([x], prescale, postscale)
    if group.size == 1:
        return x if prescale * postscale == 1.0 else x * (prescale * postscale)
    out = _outputs.POOL.empty(x.shape, x.dtype)
    send = None  # the transport reads ``x`` itself: no copy into ``out`` first
    if prescale != 1.0:
        np.multiply(x, prescale, out=out, casting="unsafe")
    elif x.flags.c_contiguous:
        send = x.reshape(-1)
    else:
        np.copyto(out, x)
    if out.size:
        with timeline.activity(name, "allreduce", out.nbytes):
            group.transport.allreduce(out.reshape(-1), _TRANSPORT_OPS[op], name=_describe(
                f"{name} {op.value}", ((x.shape, x.dtype.str),), 1), send=send)
        COUNTERS["allreduce"] += 1
    if op is ReduceOp.AVERAGE and not _is_float(x.dtype):
        np.floor_divide(out, group.size, out=out)
    else:
        scale = postscale / group.size if op is ReduceOp.AVERAGE else postscale
        if scale != 1.0:
            np.multiply(out, scale, out=out, casting="unsafe")
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
    group = _context.get()
    _check_allreduce_inputs(arrays, prescale, postscale)
    if group.size == 1:
        if prescale * postscale == 1.0:
            return arrays
        return [a * (prescale * postscale) for a in arrays]
    transport = group.transport
    code = _TRANSPORT_OPS[op]
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
            if op is ReduceOp.AVERAGE and not _is_float(dtype):
                results = fusion.unpack(flat, members)
                for result in results:
                    np.floor_divide(result, group.size, out=result)
            else:
                scale = postscale / group.size if op is ReduceOp.AVERAGE else postscale
                results = fusion.unpack(flat, members, scale)
            for index, result in zip(bucket, results):
                outputs[index] = result
    return outputs


def _broadcast_arrays(arrays: list[np.ndarray], root: int, name: str) -> list[np.ndarray]:
    group = _context.get()
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
    group = _context.get()
    array = np.ascontiguousarray(array)
    if array.ndim == 0:
        array = array.reshape(1)
    if group.size == 1:
        return array.copy()
    _check_dtypes([array], "allgather")
    if array.ndim > _MAX_GATHER_NDIM:
        raise ValueError(f"`allgather` takes at most {_MAX_GATHER_NDIM} dimensions. "
                         f"Received: shape={array.shape}")
    # Shapes first: ranks may differ in the first dimension only.
    header = np.zeros(2 + _MAX_GATHER_NDIM, np.int64)
    header[:2] = array.ndim, _dtypes.dtype_code(array.dtype)
    header[2 : 2 + array.ndim] = array.shape
    headers = np.empty(header.size * group.size, np.int64)
    group.transport.allgatherv(header, headers, [header.size] * group.size,
                               name=f"{name} shapes")
    headers = headers.reshape(group.size, -1)
    shapes = [tuple(int(d) for d in h[2 : 2 + h[0]]) for h in headers]
    if any((h[0], h[1]) != (headers[0][0], headers[0][1]) or shape[1:] != shapes[0][1:]
           for h, shape in zip(headers, shapes)):
        names = {code: np.dtype(d).name for d, code in _dtypes._CODES.items()}
        detail = ", ".join(f"rank {r}: shape={shape} dtype={names.get(int(h[1]), h[1])}"
                           for r, (h, shape) in enumerate(zip(headers, shapes)))
        raise ValueError(
            "`allgather` needs the same dtype and the same shape past the first "
            f"dimension on every rank. Received: {detail}"
        )
    counts = [int(np.prod(shape)) for shape in shapes]
    out = _outputs.POOL.empty((sum(shape[0] for shape in shapes), *array.shape[1:]), array.dtype)
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
    _context.get()
    if isinstance(xs, (str, bytes)) or not isinstance(xs, Sequence):
        raise TypeError(f"`xs` must be a list or tuple of tensors. Received: {type(xs)}")
    if not xs:
        return []
    if any(_is_cupy(_unwrap(x)) for x in xs):
        from keras_dist import _gpu

        return _gpu.grouped_allreduce(list(xs), op, prescale_factor, postscale_factor,
                                      compression)
    compressed, contexts = zip(*(compression.compress(_unwrap(x)) for x in xs))
    results = _run(
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
    _context.get()
    return _run([x], lambda arrays: [_allgather_array(arrays[0], name or "allgather")],
                "allgather", shapes=lambda s: [None, *s[1:]])[0]


def broadcast(x, root_rank: int, name: str | None = None):
    """Returns ``root_rank``'s ``x`` on every rank. Shapes and dtypes must match."""
    group = _context.get()
    root = _check_root(root_rank, group.size)
    return _run([x], lambda arrays: _broadcast_arrays(arrays, root, name or "broadcast"),
                "broadcast")[0]


def broadcast_variables(variables: Sequence, root_rank: int = 0) -> None:
    """Assigns ``root_rank``'s values to ``variables`` (Keras or TF) on every rank.

    All variables travel in fused buckets, one transport call per dtype bucket.
    """
    group = _context.get()
    root = _check_root(root_rank, group.size)
    variables = list(variables)
    if group.size == 1 or not variables:
        return
    values = [np.asarray(_to_numpy(v)) for v in variables]
    for variable, value in zip(variables, _broadcast_arrays(values, root, "broadcast_variables")):
        variable.assign(value)


def broadcast_object(obj, root_rank: int = 0):
    """Returns ``root_rank``'s picklable ``obj`` on every rank."""
    group = _context.get()
    root = _check_root(root_rank, group.size)
    if group.size == 1:
        return obj
    payload = np.frombuffer(pickle.dumps(obj), np.uint8) if group.rank == root else None
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
    group = _context.get()
    if group.size == 1:
        return [obj]
    payload = np.frombuffer(pickle.dumps(obj), np.uint8)
    lengths = _allgather_array(np.array([payload.size], np.int64), "allgather_object lengths")
    gathered = _allgather_array(payload, "allgather_object")
    COUNTERS["allgather_object"] += 1
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return [pickle.loads(gathered[offsets[r] : offsets[r + 1]].tobytes())
            for r in range(group.size)]


def barrier() -> None:
    """Returns once every rank has called ``barrier``."""
    group = _context.get()
    group.transport.barrier()
    COUNTERS["barrier"] += 1
