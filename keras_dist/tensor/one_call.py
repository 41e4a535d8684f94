"""The one-call paths of ``allreduce``, ``broadcast`` and ``allgather``.

A small C-contiguous numpy array, with no option set, goes to the job's
native engine in one native call (``_native.dispatch_*``) where the runtime
has handed one over (``context.install``: the job's transport has a
``native_engine``) and no timeline records (the timeline says so:
``set_dispatch_recording``). The call validates the array, names it as the
general path does (``allreduce_plans.describe``: peers may take either
path), counts it in ``COUNTERS`` and returns a new array, or None for
anything else; the general path then runs and makes every check. The
functions here only turn the engine's errors into keras_dist's.
"""

from __future__ import annotations

import numpy as np

from keras_dist import _native, _vocab
from keras_dist._runtime import context
from keras_dist._vocab import Average
from keras_dist.errors import CollectiveMismatchError
from keras_dist.tensor import allreduce_plans, gather_records
from keras_dist.tensor.counters import COUNTERS

_native.dispatch_setup(COUNTERS, (Average, _vocab.Sum, _vocab.Min, _vocab.Max, _vocab.Product))

#: The native entries: a new array, or None (the general path).
dispatch_allreduce = _native.dispatch_allreduce
dispatch_broadcast = _native.dispatch_broadcast
dispatch_allgather = _native.dispatch_allgather
#: The base class of the errors they raise (the engine's), which the
#: functions below translate.
EngineError = _native.EngineError


def allreduce_failed(native: BaseException, x: np.ndarray, op, name) -> np.ndarray:
    """The one-call allreduce's engine error ``native`` raised as keras_dist's,
    or, when ranks have joined, the result as the general path has it."""
    group = context.get()
    error = group.transport.translate_native_error(native)
    if type(error) is not CollectiveMismatchError:
        raise error from None
    op = op or Average
    described = allreduce_plans.describe(f"{name or 'allreduce'} {op.value}",
                                         ((x.shape, x.dtype.str),), 1)
    result = group.transport.allreduce_mismatched(
        error, x.reshape(-1), _vocab.TRANSPORT_OPS[op], described).reshape(x.shape)
    _vocab.finish_reduction(result, op, group.size, 1.0)
    COUNTERS["allreduce"] += 1
    return result


def broadcast_failed(native: BaseException, x: np.ndarray, root_rank, name):
    """Raises the one-call broadcast's engine error ``native`` as keras_dist's."""
    transport = context.get().transport
    error = transport.translate_native_error(native)
    if type(error) is CollectiveMismatchError:
        transport.raise_mismatched(
            error, "broadcast", x.reshape(-1).view(np.uint8),
            allreduce_plans.describe(name or "broadcast", ((x.shape, x.dtype.str),), 1), root_rank)
    raise error from None


def allgather_failed(native: BaseException, name, transport=None):
    """Raises the one-call allgather's engine error ``native`` as keras_dist's
    (``transport``: the group's, default the job's)."""
    transport = transport or context.get().transport
    error = transport.translate_native_error(native)
    if type(error) is CollectiveMismatchError:  # at the records' step, the first
        transport.raise_mismatched(
            error, "allgather", np.zeros(gather_records.RECORD_BYTES, np.uint8),
            f"{name or 'allgather'} shapes")
    raise error from None
