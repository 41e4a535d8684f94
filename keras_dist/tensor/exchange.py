"""Collectives that exchange rows between ranks: ``alltoall``, ``reducescatter``,
``grouped_allgather`` and ``grouped_reducescatter``.

They take the same kinds of values as the collectives of ``ops`` (numpy, TF
eager or symbolic, Keras variables; cupy values travel through host memory)
and are built on the transport primitives every transport has:

* ``alltoall`` agrees on every rank's ``splits`` with one small allgather,
  then moves the rows with one allgather of every rank's rows, of which each
  rank keeps the blocks addressed to it. Each rank receives all the data
  sent, not only its own: simple and correct on every transport, at
  ``size`` times the traffic of a dedicated all-to-all.
* ``reducescatter`` is an allreduce (fused, as ``grouped_allreduce``) of
  which each rank keeps its own rows: twice the traffic of a dedicated
  reduce-scatter.
* ``grouped_allgather`` agrees on every value's shape with one small
  allgather, then moves all the values with one allgather of bytes.

Every call checks that all ranks agree before data moves, as the other
collectives do: a rank whose arguments are invalid raises ``ValueError``
and its peers a ``CollectiveMismatchError`` naming it, so no rank is left
waiting.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from keras_dist import _vocab
from keras_dist._runtime import context, timeline
from keras_dist._vocab import Average, ReduceOp
from keras_dist.errors import CollectiveMismatchError
from keras_dist.tensor import gather_records, kinds, outputs
from keras_dist.tensor.checks import check_byte_dtypes as _check_byte_dtypes
from keras_dist.tensor.checks import check_dtypes as _check_dtypes
from keras_dist.tensor.checks import check_op as _check_op
from keras_dist.tensor.collective import Collective
from keras_dist.tensor.compression import Compression
from keras_dist.tensor.conversions import run
from keras_dist.tensor.counters import COUNTERS
from keras_dist.tensor.gather_records import MAX_NDIM as _MAX_GATHER_NDIM
from keras_dist.tensor.kinds import dtype_of, unwrap
from keras_dist.tensor.ops import allgather, allreduce, allreduce_arrays
from keras_dist.tensor.tf import ops as tf_ops
from keras_dist.tensor.tf.errors import raising_tf_errors


def _disagreement(descriptions: np.ndarray) -> str | None:
    """Rank by rank, what differs when ranks' values (rows of
    ``gather_records.header_of``: ndim, dtype number, shape) differ in ndim,
    dtype or shape past the first dimension; None when they agree."""
    shapes = gather_records.shapes_of(descriptions)
    first = descriptions[0]
    if all((d[0], d[1]) == (first[0], first[1]) and shape[1:] == shapes[0][1:]
           for d, shape in zip(descriptions, shapes)):
        return None
    return gather_records.describe(descriptions)


def _raise_problems(problems: np.ndarray, mine: str | None, collective: str) -> None:
    """Raises on every rank when any rank's arguments were invalid.

    ``problems[r]`` is nonzero where rank ``r`` found its own arguments
    invalid; that rank raises its ``ValueError`` (``mine``), the others a
    ``CollectiveMismatchError`` naming it.
    """
    bad = [int(r) for r in np.flatnonzero(problems)]
    if not bad:
        return
    if mine is not None:
        raise ValueError(mine)
    raise CollectiveMismatchError(
        f"`{collective}` did not run: ranks {bad} passed invalid arguments "
        "(each of them raised a ValueError saying which)."
    )


def _row_elements(array: np.ndarray) -> int:
    return int(np.prod(array.shape[1:], dtype=np.int64))


# ---------------------------------------------------------------------------
# alltoall


def _splits_problem(x: np.ndarray, splits: np.ndarray | None, size: int) -> str | None:
    """What is wrong with ``x`` and ``splits`` for an alltoall, or None."""
    if x.ndim == 0:
        return ("`alltoall` needs `x` with at least one dimension (rows to split). "
                f"Received: x.shape={x.shape}")
    if x.ndim > _MAX_GATHER_NDIM:
        return (f"`alltoall` takes at most {_MAX_GATHER_NDIM} dimensions. "
                f"Received: x.shape={x.shape}")
    if splits is None:
        if x.shape[0] % size:
            return ("`x`'s first dimension must be a multiple of the number of ranks when "
                    f"`splits` is None. Received: x.shape={x.shape} (size={size})")
        return None
    if splits.dtype.kind not in "iu" or splits.ndim != 1 or splits.size != size:
        return (f"`splits` must be a vector of {size} integers, one per rank. "
                f"Received: splits={splits.tolist()} (dtype={splits.dtype.name}, "
                f"shape={splits.shape})")
    if (splits < 0).any():
        return f"`splits` must not be negative. Received: splits={splits.tolist()}"
    if int(splits.sum()) > x.shape[0]:
        return ("`splits` must sum to at most the first dimension of `x`. "
                f"Received: splits={splits.tolist()} (sum {int(splits.sum())}), "
                f"x.shape={x.shape}")
    return None


def _alltoall_arrays(x: np.ndarray, splits: np.ndarray | None, name: str,
                     group) -> list[np.ndarray]:
    """``[received, received_splits]``: rank r's ``splits[me]`` rows, in rank order."""
    size, me = group.size, group.rank
    problem = _splits_problem(x, splits, size)
    x = np.ascontiguousarray(x)  # (a scalar would become a vector: checked first)
    if problem is None:
        splits = (np.full(size, x.shape[0] // size, np.int64) if splits is None
                  else splits.astype(np.int64))
    if size == 1:
        if problem is not None:
            raise ValueError(problem)
        return [x[: splits[0]].copy(), splits.astype(np.int32)]
    # Agree first: every rank's problem flag, value description and splits.
    header = np.zeros(1 + gather_records.HEADER_WORDS + size, np.int64)
    header[0] = problem is not None
    if problem is None:
        header[1 : 1 + gather_records.HEADER_WORDS] = gather_records.header_of(x)
        header[1 + gather_records.HEADER_WORDS :] = splits
    headers = np.empty(header.size * size, np.int64)
    group.transport.allgatherv(header, headers, [header.size] * size,
                               name=f"{name} splits of {size} ranks")
    headers = headers.reshape(size, -1)
    _raise_problems(headers[:, 0], problem, "alltoall")
    detail = _disagreement(headers[:, 1 : 1 + gather_records.HEADER_WORDS])
    if detail is not None:
        raise CollectiveMismatchError(
            "`alltoall` needs the same dtype and the same shape past the first dimension "
            f"on every rank. Received: {detail}"
        )
    # matrix[r, k]: the rows rank r sends to rank k.
    matrix = headers[:, 1 + gather_records.HEADER_WORDS :]
    received_splits = matrix[:, me]
    row_bytes = _row_elements(x) * x.dtype.itemsize
    sent_bytes = matrix.sum(axis=1) * row_bytes
    out = outputs.POOL.empty((int(received_splits.sum()), *x.shape[1:]), x.dtype)
    if sent_bytes.sum():
        gathered = np.empty(int(sent_bytes.sum()), np.uint8)
        with timeline.activity(name, "alltoall", gathered.nbytes, group.transport):
            group.transport.allgatherv(
                x.reshape(-1).view(np.uint8)[: sent_bytes[me]], gathered,
                sent_bytes.tolist(), name=_describe_alltoall(name, x, matrix))
        COUNTERS["alltoall"] += 1
        target = out.reshape(-1).view(np.uint8)
        starts = np.concatenate([[0], np.cumsum(sent_bytes)[:-1]])
        written = 0
        for r in range(size):
            begin = int(starts[r] + matrix[r, :me].sum() * row_bytes)
            length = int(matrix[r, me] * row_bytes)
            target[written : written + length] = gathered[begin : begin + length]
            written += length
    return [out, received_splits.astype(np.int32)]


def _describe_alltoall(name: str, x: np.ndarray, matrix: np.ndarray) -> str:
    return f"{name} {x.dtype.name}{list(x.shape[1:])} rows {matrix.tolist()}"


def _alltoall_grad(process_set):
    """The gradient of an alltoall: the alltoall of the gradient back, with the
    received splits as splits (zeros for rows past ``sum(splits)``, never sent)."""

    def grad(inputs: list, outputs_: list, upstream: list) -> list:
        import tensorflow as tf

        returned, _ = alltoall(upstream[0], splits=outputs_[1], process_set=process_set)
        unsent = tf.shape(inputs[0])[0] - tf.shape(returned)[0]
        padding = tf.concat([[[0, unsent]], tf.zeros([tf.rank(returned) - 1, 2], tf.int32)], 0)
        return [tf.pad(returned, padding)] + [None] * (len(inputs) - 1)

    return grad


@raising_tf_errors
def alltoall(x, splits=None, name: str | None = None, process_set=None):
    """Sends ``splits[k]`` rows of ``x`` to rank ``k``; returns the rows received.

    The rows of ``x`` (its first dimension) go out in order: the first
    ``splits[0]`` to rank 0, the next ``splits[1]`` to rank 1, and so on.
    Rows past ``sum(splits)`` are not sent. Ranks may send different numbers
    of rows; the other dimensions and the dtype must match.

    Args:
        x: a numpy array, TF tensor (eager or symbolic), Keras variable or
            cupy array, with at least one dimension.
        splits: one non-negative integer per rank of ``process_set`` (a list,
            numpy array or TF tensor), summing to at most ``x``'s first
            dimension. None: the rows are split equally (their number must
            then be a multiple of the number of ranks).
        name: a label for the timeline.
        process_set: the ranks to exchange among (default: every rank).

    Returns:
        As Horovod's: with ``splits`` given, ``(received, received_splits)``;
        without, ``received`` alone. ``received`` holds the rows from rank 0,
        then rank 1, ..., of the same kind and dtype as ``x``;
        ``received_splits`` (int32, of the kind of ``x``) says how many rows
        came from each rank.

    Raises:
        ValueError: invalid ``splits`` or ``x`` on this rank (also
            ``tf.errors.InvalidArgumentError`` for TF values).
        CollectiveMismatchError: ranks passed different dtypes or shapes past
            the first dimension, or another rank's arguments were invalid
            (also ``tf.errors.FailedPreconditionError`` for TF values).
    """
    group = context.group_for(process_set)
    _check_byte_dtypes([dtype_of(x)], "alltoall")
    values = [x] if splits is None else [x, splits]
    received = run(values, Collective(
        lambda arrays: _alltoall_arrays(arrays[0], None if splits is None else arrays[1],
                                        name or "alltoall", group),
        "alltoall",
        shapes=lambda shapes: [_rows_unknown(shapes[0]), [group.size]],
        grad=_alltoall_grad(process_set),
        out_dtypes=[dtype_of(x), np.int32],
    ))
    return tuple(received) if splits is not None else received[0]


def _rows_unknown(shape) -> list | None:
    """``shape`` with its first dimension unknown (None for an unknown rank)."""
    if shape.rank is None:
        return None
    return [None, *shape[1:]]


# ---------------------------------------------------------------------------
# grouped_allgather


def _grouped_allgather_arrays(arrays: list[np.ndarray], name: str, group) -> list[np.ndarray]:
    arrays = [np.ascontiguousarray(a) for a in arrays]
    arrays = [a.reshape(1) if a.ndim == 0 else a for a in arrays]
    for index, array in enumerate(arrays):
        if array.ndim > _MAX_GATHER_NDIM:
            raise ValueError(f"`grouped_allgather` takes at most {_MAX_GATHER_NDIM} dimensions. "
                             f"Received: shape={array.shape} at position {index}")
    size = group.size
    if size == 1:
        return [a.copy() for a in arrays]
    count = len(arrays)
    header = np.concatenate([gather_records.header_of(a) for a in arrays])
    headers = np.empty(header.size * size, np.int64)
    group.transport.allgatherv(header, headers, [header.size] * size,
                               name=f"{name} shapes of {count} tensors")
    headers = headers.reshape(size, count, gather_records.HEADER_WORDS)
    for index in range(count):
        detail = _disagreement(headers[:, index])
        if detail is not None:
            raise CollectiveMismatchError(
                "`grouped_allgather` needs, at each position, the same dtype and the same "
                f"shape past the first dimension on every rank. Received at position {index}: "
                f"{detail}"
            )
    rows = headers[:, :, 2]  # rows[r, i]: the rows rank r gives of value i
    row_bytes = np.array([_row_elements(a) * a.itemsize for a in arrays], np.int64)
    sent_bytes = rows @ row_bytes
    results = [outputs.POOL.empty((int(rows[:, i].sum()), *a.shape[1:]), a.dtype)
               for i, a in enumerate(arrays)]
    if not sent_bytes.sum():
        return results
    with timeline.activity(name, "allgather", int(sent_bytes.sum()), group.transport):
        if count == 1:  # straight into the result
            group.transport.allgatherv(arrays[0].reshape(-1).view(np.uint8),
                                       results[0].reshape(-1).view(np.uint8),
                                       sent_bytes.tolist(), name=name)
        else:
            send = np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays])
            gathered = np.empty(int(sent_bytes.sum()), np.uint8)
            group.transport.allgatherv(send, gathered, sent_bytes.tolist(), name=name)
            targets = [r.reshape(-1).view(np.uint8) for r in results]
            written = np.zeros(count, np.int64)
            offset = 0
            for r in range(size):
                for i in range(count):
                    length = int(rows[r, i] * row_bytes[i])
                    targets[i][written[i] : written[i] + length] = \
                        gathered[offset : offset + length]
                    written[i] += length
                    offset += length
    COUNTERS["allgather"] += 1
    return results


def _grouped_allgather_grad(process_set):
    """The gradient of a grouped allgather: each value's as for ``allgather``,
    one after the other."""
    single = tf_ops.allgather_grad(allgather, allreduce, process_set)

    def grad(inputs: list, outputs_: list, upstream: list) -> list:
        grads: list = []
        done: list = []
        for x, y, u in zip(inputs, outputs_, upstream):
            with kinds.after(done):
                g = single([x], [y], [u])[0]
            grads.append(g)
            if g is not None:
                done = [g]
        return grads

    return grad


def _check_list(xs, collective: str) -> list:
    if isinstance(xs, (str, bytes)) or not isinstance(xs, Sequence):
        raise TypeError(f"`{collective}` takes a list or tuple of tensors. "
                        f"Received: {type(xs).__name__}")
    return list(xs)


@raising_tf_errors
def grouped_allgather(xs: Sequence, name: str | None = None, process_set=None) -> list:
    """``allgather`` of every value of ``xs`` at once (one transfer for all).

    Every rank passes the same number of values; at each position the dtypes
    and the shapes past the first dimension must match (the first dimension
    may differ between ranks and between values).

    Returns:
        A list of the gathered values, as ``allgather`` returns them.

    Raises:
        CollectiveMismatchError: ranks passed different dtypes or shapes past
            the first dimension (also ``tf.errors.FailedPreconditionError``
            for TF values).
    """
    group = context.group_for(process_set)
    xs = _check_list(xs, "grouped_allgather")
    if not xs:
        return []
    _check_byte_dtypes([dtype_of(x) for x in xs], "grouped_allgather")
    return run(xs, Collective(
        lambda arrays: _grouped_allgather_arrays(arrays, name or "grouped_allgather", group),
        "grouped_allgather", shapes=lambda shapes: [_rows_unknown(s) for s in shapes],
        grad=_grouped_allgather_grad(process_set)))


# ---------------------------------------------------------------------------
# reducescatter


def own_rows(rows: int, size: int, rank: int) -> tuple[int, int]:
    """``[begin, end)`` of ``rank``'s rows when ``rows`` are scattered over ``size``
    ranks: as equal as can be, the first ``rows % size`` ranks one more."""
    base, extra = divmod(rows, size)
    begin = rank * base + min(rank, extra)
    return begin, begin + base + (rank < extra)


def _check_reducescatter_op(op) -> ReduceOp:
    op = _check_op(op)
    if op not in (Average, _vocab.Sum):
        raise ValueError(
            f"`reducescatter` supports op=Average and op=Sum. Received: op={op}"
        )
    return op


def _reducescatter_arrays(arrays: list[np.ndarray], op: ReduceOp, prescale: float,
                          postscale: float, name: str, group) -> list[np.ndarray]:
    for index, array in enumerate(arrays):
        if array.ndim == 0:
            raise ValueError(
                "`reducescatter` needs values with at least one dimension (rows to "
                f"scatter). Received: shape=() at position {index}"
            )
    reduced = allreduce_arrays(arrays, op, prescale, postscale, name, group)
    mine = []
    for result in reduced:
        begin, end = own_rows(result.shape[0], group.size, group.rank)
        mine.append(result[begin:end].copy())
    return mine


def _reducescatter_grad(op: ReduceOp, prescale: float, postscale: float, process_set):
    """The gradient of a (grouped) reducescatter, as Horovod defines it: the
    allgather of the gradients times ``prescale * postscale`` (and times the
    number of ranks for ``Sum``)."""

    def grad(inputs: list, outputs_: list, upstream: list) -> list:
        import tensorflow as tf

        size = context.group_for(process_set).size
        factor = prescale * postscale * (size if op is _vocab.Sum else 1)
        floating = [i for i, x in enumerate(inputs) if x.dtype.is_floating or x.dtype.is_complex]
        scaled = [upstream[i] if factor == 1.0 else upstream[i] * tf.cast(factor, upstream[i].dtype)
                  for i in floating]
        grads: list = [None] * len(inputs)
        for i, g in zip(floating, grouped_allgather(scaled, process_set=process_set)):
            grads[i] = g
        return grads

    return grad


@raising_tf_errors
def reducescatter(x, op: ReduceOp | None = Average, name: str | None = None,
                  process_set=None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, compression=Compression.none):
    """Reduces ``x`` across ranks and returns this rank's rows of the result.

    The rows (first dimension) are scattered in rank order, as equally as
    possible: with ``n`` rows, the first ``n % size`` ranks get
    ``n // size + 1`` rows, the others ``n // size``.

    Args:
        x: a numpy array, TF tensor (eager or symbolic), Keras variable or
            cupy array with at least one dimension, of the same shape and
            dtype on every rank.
        op: ``Average`` (default) or ``Sum``. ``Average`` of integers rounds down.
        name: a label for the timeline.
        process_set: the ranks to reduce over (default: every rank).
        prescale_factor: multiplies ``x`` before the reduction.
        postscale_factor: multiplies the result (scaling as ``allreduce``).
        compression: ``Compression.none`` or ``Compression.fp16``.

    Returns:
        This rank's rows of the reduction, of the kind and dtype of ``x``.

    Raises:
        ValueError: an op other than ``Average`` or ``Sum``, or a scalar ``x``.
        CollectiveMismatchError: ranks passed different shapes or dtypes
            (also ``tf.errors.FailedPreconditionError`` for TF values).
    """
    return grouped_reducescatter([x], op=op, name=name, process_set=process_set,
                                 prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor, compression=compression)[0]


@raising_tf_errors
def grouped_reducescatter(xs: Sequence, op: ReduceOp | None = Average, name: str | None = None,
                          process_set=None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, compression=Compression.none) -> list:
    """``reducescatter`` of every value of ``xs`` at once, fused by dtype.

    Every rank passes the same number of values with the same shapes and
    dtypes, in the same order. Arguments as for ``reducescatter``.

    Returns:
        A list of this rank's rows of each reduction.
    """
    op = _check_reducescatter_op(op)
    group = context.group_for(process_set)
    xs = _check_list(xs, "grouped_reducescatter")
    if not xs:
        return []
    _check_dtypes([dtype_of(x) for x in xs], "reducescatter")
    prescale, postscale = float(prescale_factor), float(postscale_factor)
    compressed, contexts = zip(*(compression.compress(unwrap(x)) for x in xs))
    results = run(compressed, Collective(
        lambda arrays: _reducescatter_arrays(arrays, op, prescale, postscale,
                                             name or "reducescatter", group),
        "reducescatter",
        shapes=lambda shapes: [_scattered_shape(s, group) for s in shapes],
        grad=_reducescatter_grad(op, prescale, postscale, process_set),
    ))
    return [compression.decompress(r, c) for r, c in zip(results, contexts)]


def _scattered_shape(shape, group) -> list | None:
    """The static shape of this rank's rows of a value shaped ``shape``."""
    if shape.rank is None:
        return None
    if shape.rank == 0:
        return []
    rows = shape[0]
    if rows is not None:
        begin, end = own_rows(rows, group.size, group.rank)
        rows = end - begin
    return [rows, *shape[1:]]
