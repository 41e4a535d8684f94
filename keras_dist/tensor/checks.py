"""Argument checks of the public collectives.

Every collective makes them before anything else, at any size (a call that
fails at 2 ranks fails the same way at 1). Messages say what must hold, then
what was received.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from keras_dist import _vocab
from keras_dist._vocab import Average, ReduceOp


def check_op(op, average: bool | None = None) -> ReduceOp:
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


def check_root(root_rank, group) -> int:
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


def check_dtypes(dtypes: Sequence[np.dtype], collective: str) -> None:
    for dtype in dict.fromkeys(dtypes):  # each dtype once (a step's gradients share one)
        if not _vocab.is_supported(dtype):
            raise TypeError(
                f"`{collective}` supports {_vocab.SUPPORTED_DTYPE_NAMES}. "
                f"Received: dtype={np.dtype(dtype).name}"
            )


def check_byte_dtypes(dtypes: Sequence[np.dtype], collective: str) -> None:
    """Broadcasts and allgathers move bytes: any fixed-size number or bool travels unchanged."""
    for dtype in dtypes:
        if not (_vocab.is_supported(dtype) or np.dtype(dtype).kind in "biufc"):
            raise TypeError(
                f"`{collective}` supports booleans and numbers. "
                f"Received: dtype={np.dtype(dtype).name}"
            )


def check_allreduce_inputs(dtypes: Sequence[np.dtype]) -> None:
    check_dtypes(dtypes, "allreduce")


def check_variables(variables) -> list:
    variables = list(variables)
    for index, variable in enumerate(variables):
        if not callable(getattr(variable, "assign", None)):
            raise TypeError(
                "`variables` must be Keras or TensorFlow variables. "
                f"Received: {type(variable).__name__} at position {index}"
            )
    return variables


def check_sparse(op: ReduceOp, prescale: float, postscale: float) -> None:
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
