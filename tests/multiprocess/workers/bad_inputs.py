"""Invalid collective calls and the error each must raise, the same at every size.

Shared by tests/unit/test_api_single_process.py (size 1) and the worker
tests/multiprocess/workers/collectives.py (every rank, at 2 and 3 ranks): the
same call must raise the same error type with the same message whatever the
number of ranks, before any data moves, so no rank is left waiting.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import numpy as np

from keras_dist._vocab import SUPPORTED_DTYPE_NAMES

_ROOT_RANK = "`root_rank` must be in [0, size). Received: root_rank={root} (size={size})"


def _unsupported(collective: str, dtype: str) -> str:
    return f"`{collective}` supports {SUPPORTED_DTYPE_NAMES}. Received: dtype={dtype}"


class FakeCupyArray:
    """Looks like a cupy array to the type check (its module is cupy's); nothing more.

    Only for the argument check that rejects a mix of device and host values,
    which runs before any cupy call.
    """

    __module__ = "cupy._core.core"
    dtype = np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class BadCall:
    """An invalid call, ``call(kd, size)``, and the error it must raise at ``size`` ranks."""

    label: str
    call: Callable
    error: type
    message: Callable[[int], str]
    #: False when only the root can tell (it alone pickles its object): the
    #: multi-rank worker cannot make that call without leaving the others waiting.
    every_rank: bool = True


def _indexed_slices():
    import tensorflow as tf

    return tf.IndexedSlices(tf.ones([1, 3]), tf.constant([0]))


def _tf_function_allgather_of_strings(kd, size):
    import tensorflow as tf

    tf.function(lambda: kd.allgather(tf.constant(["a", "b"])), autograph=False)()


def _moved_as_bytes(collective: str, dtype: str) -> str:
    return f"`{collective}` supports booleans and numbers. Received: dtype={dtype}"


CASES = [
    BadCall("allgather of strings in a tf.function", _tf_function_allgather_of_strings,
            TypeError, lambda size: _moved_as_bytes("allgather", "object")),
    BadCall("allgather of an object array",
            lambda kd, size: kd.allgather(np.array([object(), object()])),
            TypeError, lambda size: _moved_as_bytes("allgather", "object")),
    BadCall("allgather of 9 dimensions",
            lambda kd, size: kd.allgather(np.zeros((1,) * 9, np.float32)),
            ValueError,
            lambda size: f"`allgather` takes at most 8 dimensions. Received: shape={(1,) * 9}"),
    BadCall("allreduce of bools",
            lambda kd, size: kd.allreduce(np.array([True])),
            TypeError, lambda size: _unsupported("allreduce", "bool")),
    BadCall("allreduce of an object array",
            lambda kd, size: kd.allreduce(np.array([object()])),
            TypeError, lambda size: _unsupported("allreduce", "object")),
    BadCall("allreduce of complex64 with fp16 compression",
            lambda kd, size: kd.allreduce(np.ones(2, np.complex64),
                                          compression=kd.Compression.fp16),
            TypeError, lambda size: _unsupported("allreduce", "complex64")),
    BadCall("grouped_allreduce with one uint32 among floats",
            lambda kd, size: kd.grouped_allreduce([np.ones(2, np.float32),
                                                   np.ones(2, np.uint32)]),
            TypeError, lambda size: _unsupported("allreduce", "uint32")),
    BadCall("both op and the legacy average",
            lambda kd, size: kd.allreduce(np.ones(2), op=kd.Sum, average=False),
            ValueError,
            lambda size: "Pass `op` or the legacy `average`, not both. "
                         "Received: op=<ReduceOp.SUM: 'sum'>, average=False"),
    BadCall("IndexedSlices with op=Max",
            lambda kd, size: kd.allreduce(_indexed_slices(), op=kd.Max),
            NotImplementedError,
            lambda size: "`allreduce` of `IndexedSlices` supports op=Sum and op=Average only. "
                         "Received: op=ReduceOp.MAX"),
    BadCall("IndexedSlices with a prescale_factor",
            lambda kd, size: kd.grouped_allreduce([_indexed_slices()], prescale_factor=0.5),
            NotImplementedError,
            lambda size: "`allreduce` of `IndexedSlices` does not scale. "
                         "Received: prescale_factor=0.5, postscale_factor=1.0"),
    BadCall("op given as a string",
            lambda kd, size: kd.grouped_allreduce([np.ones(2)], op="sum"),
            ValueError,
            lambda size: "`op` must be one of keras_dist.Average, Sum, Min, Max, Product. "
                         "Received: op='sum'"),
    BadCall("grouped_allreduce of one array",
            lambda kd, size: kd.grouped_allreduce(np.ones(2)),
            TypeError,
            lambda size: "`xs` must be a list or tuple of tensors. "
                         "Received: <class 'numpy.ndarray'>"),
    BadCall("grouped_allreduce mixing device and host values",
            lambda kd, size: kd.grouped_allreduce([np.ones(2, np.float32), FakeCupyArray()]),
            TypeError,
            lambda size: "`grouped_allreduce` takes cupy arrays only or host values only in one "
                         "call. Received: cupy arrays at positions [1] and other values at [0]"),
    BadCall("broadcast of strings",
            lambda kd, size: kd.broadcast(np.array(["a", "b"]), root_rank=0),
            TypeError,
            lambda size: _moved_as_bytes("broadcast", "str32")),
    BadCall("broadcast of an object array",
            lambda kd, size: kd.broadcast(np.array([object()]), root_rank=0),
            TypeError,
            lambda size: _moved_as_bytes("broadcast", "object")),
    BadCall("broadcast from root_rank=size",
            lambda kd, size: kd.broadcast(np.ones(2), root_rank=size),
            ValueError, lambda size: _ROOT_RANK.format(root=size, size=size)),
    BadCall("broadcast from a bool root_rank",
            lambda kd, size: kd.broadcast(np.ones(2), root_rank=True),
            ValueError, lambda size: "`root_rank` must be an integer. Received: root_rank=True"),
    BadCall("broadcast_object from root_rank=-1",
            lambda kd, size: kd.broadcast_object({"a": 1}, root_rank=-1),
            ValueError, lambda size: _ROOT_RANK.format(root=-1, size=size)),
    BadCall("broadcast_variables of a numpy array",
            lambda kd, size: kd.broadcast_variables([np.ones(2)], root_rank=0),
            TypeError,
            lambda size: "`variables` must be Keras or TensorFlow variables. "
                         "Received: ndarray at position 0"),
    BadCall("broadcast_variables from root_rank=size",
            lambda kd, size: kd.broadcast_variables([], root_rank=size),
            ValueError, lambda size: _ROOT_RANK.format(root=size, size=size)),
    BadCall("allgather_object of a lock",
            lambda kd, size: kd.allgather_object(threading.Lock()),
            TypeError, lambda size: "cannot pickle '_thread.lock' object"),
    BadCall("broadcast_object of a lock",
            lambda kd, size: kd.broadcast_object(threading.Lock(), root_rank=0),
            TypeError, lambda size: "cannot pickle '_thread.lock' object", every_rank=False),
]


def _also_tf(error: Exception) -> bool:
    import sys

    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(error, tf.errors.OpError)


def raised(case: BadCall, kd, size: int) -> str | None:
    """None when ``case`` raised what it must at ``size``, else what went differently.

    Calls with TensorFlow values raise a class that is also TensorFlow's
    matching ``tf.errors`` class: a subclass of ``case.error``.
    """
    try:
        case.call(kd, size)
    except Exception as error:  # noqa: BLE001 - any other error is the finding
        expected = case.message(size)
        if type(error).__mro__[1 if _also_tf(error) else 0] is case.error \
                and str(error) == expected:
            return None
        return (f"{case.label}: raised {type(error).__name__}: {error}; expected "
                f"{case.error.__name__}: {expected}")
    return f"{case.label}: raised nothing; expected {case.error.__name__}: {case.message(size)}"
