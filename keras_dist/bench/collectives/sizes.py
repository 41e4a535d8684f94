"""The sizes a run steps through and the bandwidths of a row (nccl-tests' arithmetic)."""

from __future__ import annotations

from keras_dist.bench.collectives.arguments import COLLECTIVES


def size_steps(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """Byte sizes ``min_bytes, min_bytes*factor, ...`` up to ``max_bytes`` inclusive."""
    if min_bytes < 1 or max_bytes < min_bytes:
        raise ValueError(
            "Sizes must satisfy 1 <= min_bytes <= max_bytes. "
            f"Received: min_bytes={min_bytes}, max_bytes={max_bytes}"
        )
    if min_bytes == max_bytes:
        return [min_bytes]
    if factor < 2:
        raise ValueError(f"`factor` must be >= 2. Received: factor={factor}")
    steps = []
    size = min_bytes
    while size <= max_bytes:
        steps.append(size)
        size *= factor
    return steps


def element_counts(collective: str, size_bytes: int, itemsize: int, nranks: int) -> int:
    """Elements a row moves: the whole buffer (allreduce, broadcast) or the
    gathered output (allgather: a whole number of elements per rank). At least
    one element per rank."""
    if collective == "allgather":
        return max(1, size_bytes // (itemsize * nranks)) * nranks
    return max(1, size_bytes // itemsize)


def bus_factor(collective: str, nranks: int) -> float:
    """nccl-tests' busbw/algbw: 2(n-1)/n allreduce, (n-1)/n allgather, 1 broadcast."""
    if nranks < 1:
        raise ValueError(f"`nranks` must be >= 1. Received: nranks={nranks}")
    if collective == "allreduce":
        return 2.0 * (nranks - 1) / nranks
    if collective == "allgather":
        return (nranks - 1) / nranks
    if collective == "broadcast":
        return 1.0
    raise ValueError(f"`collective` must be one of {COLLECTIVES}. Received: {collective!r}")


def bandwidths(collective: str, size_bytes: int, seconds: float,
               nranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes per second) for ``size_bytes`` in ``seconds``."""
    algbw = size_bytes / seconds / 1e9 if seconds > 0 else 0.0
    return algbw, algbw * bus_factor(collective, nranks)
