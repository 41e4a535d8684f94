"""Data sharding: each rank gets its part, every sample used once per epoch."""

from __future__ import annotations

import numpy as np

from keras_dist._runtime import context


def _local_range(count: int, rank: int, size: int) -> tuple[int, int]:
    """Rank ``rank``'s [start, end) of ``count`` items; parts differ by at most one."""
    return rank * count // size, (rank + 1) * count // size


def _local_indices(n: int, rank: int, size: int, batch_size: int | None,
                   drop_remainder: bool) -> np.ndarray:
    if batch_size is None:
        start, end = _local_range(n, rank, size)
        return np.arange(start, end)
    global_batch = batch_size * size
    full, rest = divmod(n, global_batch)
    parts = [
        np.arange(b * global_batch + rank * batch_size, b * global_batch + (rank + 1) * batch_size)
        for b in range(full)
    ]
    if rest and not drop_remainder:
        if rest < size:
            raise ValueError(
                f"The last global batch has {rest} samples, fewer than the {size} ranks, so "
                "some ranks would run one step fewer and the others would wait for them. "
                f"Pass drop_remainder=True or another batch_size. Received: {n} samples, "
                f"batch_size={batch_size}, size={size}"
            )
        start, end = _local_range(rest, rank, size)
        parts.append(np.arange(full * global_batch + start, full * global_batch + end))
    return np.concatenate(parts) if parts else np.arange(0)


def _check(batch_size, rank, size):
    if rank is None or size is None:
        group = context.get()
        rank = group.rank if rank is None else rank
        size = group.size if size is None else size
    if not 0 <= rank < size:
        raise ValueError(f"`rank` must be in [0, size). Received: rank={rank} (size={size})")
    if batch_size is not None and (isinstance(batch_size, bool) or batch_size < 1):
        raise ValueError(f"`batch_size` must be >= 1. Received: batch_size={batch_size}")
    return rank, size


def shard(data, *, batch_size: int | None = None, drop_remainder: bool = False,
          rank: int | None = None, size: int | None = None):
    """Returns this rank's part of ``data``.

    Every sample goes to exactly one rank, so across ranks each sample is used
    once per epoch.

    Without ``batch_size``, rank ``r`` gets a contiguous block (numpy) or the
    elements ``r, r + size, ...`` (`tf.data.Dataset`); parts differ in length
    by at most one. With ``batch_size``, the data is cut into global batches
    of ``size * batch_size`` consecutive samples and rank ``r`` gets the
    ``r``-th slice of each, so local batch ``k`` on every rank together is
    global batch ``k``: N ranks at batch ``b`` see what one process sees at
    batch ``N * b``, and every rank runs the same number of steps. The last,
    smaller global batch is split as evenly as possible (or dropped with
    ``drop_remainder=True``). A dataset then comes back batched (local
    batches of ``batch_size``); numpy data comes back in that order, to be
    fed with ``fit(..., batch_size=batch_size)``.

    Args:
        data: a numpy array, a tuple/list/dict of numpy arrays with the same
            first dimension, or a `tf.data.Dataset` of single samples.
        batch_size: the local (per-rank) batch size, or ``None``.
        drop_remainder: drop the last incomplete global batch.
        rank: defaults to `keras_dist.rank()`.
        size: defaults to `keras_dist.size()`.

    Returns:
        Data of the same structure, holding this rank's samples.

    Raises:
        ValueError: arrays of different lengths, or a last global batch with
            fewer samples than ranks (some ranks would have no last batch).

    Example:

    ```python
    x_train, y_train = kd.shard((x_train, y_train), batch_size=64)
    model.fit(x_train, y_train, batch_size=64)
    ```
    """
    rank, size = _check(batch_size, rank, size)
    if type(data).__module__.startswith("tensorflow"):
        return _shard_dataset(data, batch_size, drop_remainder, rank, size)
    if isinstance(data, dict):
        keys = list(data)
        parts = shard(tuple(data[k] for k in keys), batch_size=batch_size,
                      drop_remainder=drop_remainder, rank=rank, size=size)
        return dict(zip(keys, parts))
    if isinstance(data, (tuple, list)):
        arrays = [np.asarray(a) for a in data]
        lengths = {len(a) for a in arrays}
        if len(lengths) > 1:
            raise ValueError(
                "Every array must have the same first dimension. "
                f"Received: lengths={[len(a) for a in arrays]}"
            )
        if not arrays:
            return type(data)()
        indices = _local_indices(len(arrays[0]), rank, size, batch_size, drop_remainder)
        return type(data)(a[indices] for a in arrays)
    array = np.asarray(data)
    return array[_local_indices(len(array), rank, size, batch_size, drop_remainder)]


def _shard_dataset(dataset, batch_size, drop_remainder, rank, size):
    import tensorflow as tf

    if batch_size is None:
        return dataset.shard(size, rank)
    cardinality = int(dataset.cardinality())
    if cardinality >= 0 and not drop_remainder and 0 < cardinality % (size * batch_size) < size:
        _local_indices(cardinality, rank, size, batch_size, drop_remainder)  # raises

    def local_slice(*batch):
        first = tf.nest.flatten(batch)[0]
        count = tf.shape(first, out_type=tf.int64)[0]
        start = rank * count // size
        end = (rank + 1) * count // size
        sliced = tf.nest.map_structure(lambda t: t[start:end], batch)
        return sliced if len(batch) > 1 else sliced[0]

    return dataset.batch(size * batch_size, drop_remainder=drop_remainder).map(local_slice)
