"""Which rank keeps the optimizer state of which weights (ZeRO-1): a pure planner.

``plan`` assigns every trainable variable (or, where allowed, blocks of its
rows) to one rank, from the variables' shapes and byte sizes alone, so every
rank computes the same plan with no collective. Two kinds of variables:

* **whole** (not splittable): placed largest first, each on the rank holding
  the fewest bytes so far (ties: the lowest rank): greedy "longest
  processing time" bin packing. Every optimizer is exact on whole variables,
  since its update of a variable reads that variable only: Adafactor's
  factored moments, Lamb's trust ratio and Muon's whole-matrix update
  included.
* **splittable** (the optimizer's update is element-wise, the variable has
  no constraint, and it has at least two rows): placed largest first after
  the whole ones, each on the rank holding the fewest bytes; where it would
  take that rank past the even share (total bytes / ranks), that rank
  takes the rows that fill it up to the even share and the rest goes on to
  the next least-loaded rank (a rank may pass the even share by at most one
  row of the variable it was filled with). A split costs nothing in exactness (the
  update is element-wise) and only a few variables are split (a rank is
  filled to the even share by at most one split), so a large embedding
  (GPT-2's 50257 x 768 token embedding is 31% of its weights) no longer
  decides the largest share.

The plan is a tuple per variable of ``Piece``s (row blocks, in row order,
covering the rows exactly once). See docs/zero.md for the balance numbers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of a variable, whose optimizer state ``rank`` keeps."""

    rank: int
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A variable as the planner sees it: its shape, bytes per element, splittable or not."""

    shape: tuple[int, ...]
    itemsize: int = 4
    splittable: bool = False

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.itemsize if self.shape else self.itemsize

    @property
    def bytes(self) -> int:
        return self.rows * self.row_bytes


def plan(tensors: Sequence[Tensor], ranks: int) -> list[tuple[Piece, ...]]:
    """Every variable's pieces: which rank keeps the state of which rows.

    Args:
        tensors: the variables, in an order every rank shares.
        ranks: the number of ranks (>= 1).

    Returns:
        One tuple of ``Piece``s per tensor, in the tensors' order.
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"`ranks` must be an integer >= 1. Received: ranks={ranks!r}")
    load = [0] * ranks
    pieces: list[list[Piece]] = [[] for _ in tensors]

    def least_loaded() -> int:
        return min(range(ranks), key=lambda r: (load[r], r))

    def largest_first(indices):
        return sorted(indices, key=lambda i: (-tensors[i].bytes, i))

    whole = [i for i, t in enumerate(tensors) if not (t.splittable and t.rows > 1)]
    split = [i for i in range(len(tensors)) if i not in set(whole)]
    for index in largest_first(whole):
        rank = least_loaded()
        pieces[index].append(Piece(rank, 0, tensors[index].rows))
        load[rank] += tensors[index].bytes
    even = sum(t.bytes for t in tensors) / ranks
    for index in largest_first(split):
        tensor, start = tensors[index], 0
        while start < tensor.rows:
            rank = least_loaded()
            room = math.ceil((even - load[rank]) / tensor.row_bytes)
            rows = tensor.rows - start if room <= 0 else min(room, tensor.rows - start)
            pieces[index].append(Piece(rank, start, start + rows))
            load[rank] += rows * tensor.row_bytes
            start += rows
    return [tuple(sorted(p, key=lambda piece: piece.start)) for p in pieces]


def loads(tensors: Sequence[Tensor], pieces: Sequence[Sequence[Piece]], ranks: int) -> list[int]:
    """Bytes each rank keeps state for under ``pieces``."""
    load = [0] * ranks
    for tensor, own in zip(tensors, pieces):
        for piece in own:
            load[piece.rank] += (piece.stop - piece.start) * tensor.row_bytes
    return load


def imbalance(tensors: Sequence[Tensor], ranks: int) -> float:
    """The largest rank's bytes over the even share (1.0: perfectly even)."""
    load = loads(tensors, plan(tensors, ranks), ranks)
    return max(load) / (sum(load) / ranks)
