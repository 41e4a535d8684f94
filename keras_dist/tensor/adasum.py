"""Adasum: the adaptive summation that ``allreduce(op=Adasum)`` computes.

Two ranks' vectors ``a`` and ``b`` combine into

    (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient stays 1 when its vector's squared norm is below the square root
of the smallest normal float64, as Horovod does). The ranks combine pairwise
by recursive doubling: at level ``d = 1, 2, 4, ...`` the partial result of
ranks ``[r, r + d)`` with that of ``[r + d, r + 2d)``, so the number of ranks
must be a power of 2. Each tensor of a group is combined on its own.

Every rank gathers every rank's tensor (through the allgather the caller
passes in, with its shape checks and bounded waits) and computes the same
combination locally in float64, so all ranks get identical results; the
result is cast back to the input's dtype. ``prescale`` multiplies each
rank's tensor before the combination, ``postscale`` the result.

A numpy-only module: ``keras_dist.tensor.ops`` calls it and hands it its
allgather, so this module imports nothing from ``ops``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from keras_dist import _vocab

#: Squared norms below this leave their coefficient at 1 (Horovod's threshold).
_TINY_NORM_SQ = float(np.sqrt(np.finfo(np.float64).tiny))

#: ``gather(array, name, group)``: every rank's ``array`` stacked along axis 0.
Gather = Callable[[np.ndarray, str, object], np.ndarray]


def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The Adasum combination of two flat float64 vectors of the same size."""
    dot = float(np.dot(a, b))
    a_norm_sq = float(np.dot(a, a))
    b_norm_sq = float(np.dot(b, b))
    a_coeff = 1.0 - 0.5 * dot / a_norm_sq if a_norm_sq >= _TINY_NORM_SQ else 1.0
    b_coeff = 1.0 - 0.5 * dot / b_norm_sq if b_norm_sq >= _TINY_NORM_SQ else 1.0
    return a_coeff * a + b_coeff * b


def tree_reduce(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """Combines the ranks' flat vectors (in rank order) by recursive doubling.

    Args:
        vectors: one flat float64 vector per rank; a power-of-2 count.

    Returns:
        The combined vector.
    """
    if not is_power_of_2(len(vectors)):
        raise NotImplementedError(_size_message(len(vectors)))
    level = list(vectors)
    while len(level) > 1:
        level = [combine(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def is_power_of_2(number: int) -> bool:
    """True for 1, 2, 4, 8, ..."""
    return number > 0 and number & (number - 1) == 0


def _size_message(size: int) -> str:
    return ("`allreduce` with op=Adasum needs a power-of-2 number of ranks "
            f"(1, 2, 4, 8, ...). Received: size={size}")


def check_inputs(dtypes: Sequence[np.dtype], group, on_gpu: bool) -> None:
    """Raises unless an Adasum allreduce of ``dtypes`` on ``group`` is supported.

    Args:
        dtypes: the numpy dtypes of the values to reduce.
        group: the process group (``keras_dist._runtime.context.Group``).
        on_gpu: whether the values are cupy arrays.

    Raises:
        TypeError: a dtype is not floating point.
        NotImplementedError: cupy values, a process set other than the whole
            job, or a number of ranks that is not a power of 2.
    """
    for dtype in dtypes:
        if not _vocab.is_float(dtype):
            raise TypeError(
                "`allreduce` with op=Adasum supports floating-point dtypes only "
                "(float16, bfloat16, float32, float64). "
                f"Received: dtype={np.dtype(dtype).name}"
            )
    if on_gpu:
        raise NotImplementedError(
            "`allreduce` with op=Adasum does not support cupy values yet; pass host "
            "(numpy or TF) values."
        )
    if group.process_set_id != 0:
        raise NotImplementedError(
            "`allreduce` with op=Adasum supports the global process set only. "
            f"Received: a process set of ranks {list(group.ranks)}"
        )
    if not is_power_of_2(group.size):
        raise NotImplementedError(_size_message(group.size))


def allreduce_arrays(arrays: list[np.ndarray], op: _vocab.ReduceOp, prescale: float,
                     postscale: float, name: str, group, labels: list[str] | None = None,
                     *, gather: Gather) -> list[np.ndarray]:
    """The Adasum allreduce of numpy arrays: one gather and combination per array.

    Takes the arguments of ``keras_dist.tensor.ops.allreduce_arrays`` (``op``
    is ``Adasum``; ``labels`` is unused) plus ``gather``, the allgather to use.

    Returns:
        One result per array, of its dtype and shape, identical on every rank.
    """
    del op, labels
    results = []
    for index, array in enumerate(arrays):
        array = np.asarray(array)
        if group.size == 1:
            stacked = array.reshape(1, -1)
        else:
            stacked = gather(array.reshape((1, *array.shape)), f"{name} adasum {index}",
                             group).reshape(group.size, -1)
        vectors = [row.astype(np.float64) * prescale for row in stacked]
        combined = tree_reduce(vectors) * postscale
        results.append(combined.reshape(array.shape).astype(array.dtype))
    return results
