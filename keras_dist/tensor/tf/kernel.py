"""The grouped allreduce and the allgathers of a traced TensorFlow step as
keras_dist's own ops.

``KerasDistAllreduce`` (``native/src/tf_kernel.cc``, loaded with
``tf.load_op_library``) hands its input and output buffers to the native
module, which reduces each bucket with the shm engine straight from
TensorFlow's inputs into the outputs: each input's own buffer where
TensorFlow lets the op reuse it (a fresh gradient), else memory the op reuses
from step to step. Nothing runs in Python on a good step but one count in ``COUNTERS``
(and, while a timeline records, the collective's span). The
``tf.numpy_function`` op it replaces pays TensorFlow's hand-over to Python
every step (measured by ``benchmarks/tf_op_ab.py``; docs/performance.md).

A bucket the engine raises on goes to the fallback ``ops`` gives for that
bucket, in Python, as the numpy path does it (``allreduce_plans.parts_mismatched``):
ranks that have joined, or an error (the op's status: a
``CollectiveMismatchError`` as FAILED_PRECONDITION, as on the numpy path).

Used when the op library loads (it is built with the native module, without
TensorFlow), the group runs on the shm engine, the call reduces with no
scale, and every shape is known when the step is traced; otherwise, or with
``KERAS_DIST_TF_OP=0``, the step keeps the ``tf.numpy_function`` op. In a
group of one rank such a call is ``identities`` (an allgather
``gathered_alone``): no op at all.

``KerasDistAllgather`` gathers each of its inputs along the first dimension
as ``kd.allgather`` does (the ranks' shapes first, then the data), straight
into outputs TensorFlow allocates once the shapes are known. A traced step's
allgathers take it (a sparse gradient's values and indices in one op) under
the same conditions, every input's rank known; where the ranks disagree or
the engine raises, the op fails with the status the numpy path would give.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable, Sequence

import numpy as np

from keras_dist import _config, _native
from keras_dist.tensor.native_plan import NativeReduction

_OP_LIBRARY = "_tf_ops.so"

#: TensorFlow status codes for the errors a bucket's fallback raises.
_INVALID_ARGUMENT, _UNKNOWN, _FAILED_PRECONDITION, _UNIMPLEMENTED = 3, 2, 9, 12


def enabled() -> bool:
    """False when ``KERAS_DIST_TF_OP`` is ``0`` (or ``false``/``off``): the numpy path."""
    return _config.switched_on("KERAS_DIST_TF_OP")


@functools.cache
def library():
    """The loaded op library, or None where it cannot load or register its op."""
    import tensorflow as tf

    path = os.path.join(os.path.dirname(_native.__file__), _OP_LIBRARY)
    if not os.path.exists(path):
        return None
    try:
        loaded = tf.load_op_library(path)
    except (tf.errors.OpError, OSError):
        return None
    return loaded if hasattr(loaded, "keras_dist_allreduce") else None


def forwarded_outputs() -> int:
    """How many of the op's outputs in this process were their inputs' buffers
    (the allreduce ran in place); 0 where the library is not loaded."""
    import ctypes

    if library() is None:
        return 0
    count = ctypes.CDLL(os.path.join(os.path.dirname(_native.__file__), _OP_LIBRARY))
    count.keras_dist_tf_forwarded_outputs.restype = ctypes.c_int64
    return int(count.keras_dist_tf_forwarded_outputs())


def status_of(error: BaseException, mismatch_class: type) -> tuple[int, str]:
    """The op's status (a TensorFlow code and a message) for a fallback's ``error``."""
    if isinstance(error, mismatch_class):
        return _FAILED_PRECONDITION, f"keras_dist {type(error).__name__}: {error}"
    if isinstance(error, (ValueError, TypeError)):
        code = _INVALID_ARGUMENT
    elif isinstance(error, NotImplementedError):
        code = _UNIMPLEMENTED
    else:
        code = _UNKNOWN
    return code, f"{type(error).__name__}: {error}"


#: Per graph being built: the native plans its ops name, kept as long as the
#: graph (and so its ops) lives.
_PLANS_OF_GRAPH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _keep(plan):
    """``plan``, kept alive as long as the graph being built, whose op runs it."""
    import tensorflow as tf

    graph = tf.compat.v1.get_default_graph()
    _PLANS_OF_GRAPH.setdefault(graph, []).append(plan)
    return plan


def allreduce(tensors: Sequence, engine, buckets: list, op_code: int, average: bool,
              fallback: Callable, record: Callable, prescale: float = 1.0,
              postscale: float = 1.0) -> list:
    """``KerasDistAllreduce`` of ``tensors`` (symbolic, every shape known).

    Args:
        engine: the group's ``_native.ShmEngine``.
        buckets: ``[(indices into tensors, dtype code, name peers check)]``.
        op_code: the engine's op; ``average`` divides a sum by the group's size.
        fallback: ``fallback(bucket, srcs, dsts, error)`` as ``_native.ReductionPlan`` calls it.
        record: ``record(start_ns, end_ns, wait_ns)`` while a timeline records.
        prescale, postscale: floating-point tensors only: each rank's input
            times ``prescale`` before the reduction, the result times
            ``postscale`` after it.

    Returns:
        The outputs, shaped as the inputs.
    """
    return allreduce_planned(tensors, engine, NativeReduction(
        buckets, op_code, average, fallback, record, prescale, postscale))


def allreduce_planned(tensors: Sequence, engine, reduction: NativeReduction) -> list:
    """``allreduce`` of ``tensors`` as ``reduction`` says, on ``engine``."""
    nbytes = [t.shape.num_elements() * t.dtype.size for t in tensors]
    plan = _keep(reduction.native_plan(engine, nbytes))
    outputs = library().keras_dist_allreduce(list(tensors), plan=plan.id,
                                             entry=_native.tf_entry_address())
    for output, tensor in zip(outputs, tensors):
        output.set_shape(tensor.shape)
    return list(outputs)


def gathers() -> bool:
    """Whether the loaded op library has ``KerasDistAllgather`` (it needs a
    TensorFlow whose C API sets unknown output shapes)."""
    return library() is not None and hasattr(library(), "keras_dist_allgather")


def allgather(tensors: Sequence, engine, names: Sequence[str], dtypes: Sequence[np.dtype],
              fallback: Callable, record: Callable) -> list:
    """``KerasDistAllgather`` of ``tensors`` (symbolic, every rank known): each
    gathered along its first dimension as ``kd.allgather`` gathers it.

    Args:
        engine: the group's ``_native.ShmEngine``.
        names: each gather's name (peers check it).
        dtypes: the tensors' numpy dtypes.
        fallback: ``fallback(index, headers, error)`` as ``_native.TfGatherPlan`` calls it.
        record: ``record(index, nbytes, start_ns, end_ns, wait_ns)`` while a timeline records.

    Returns:
        The outputs, shaped ``[None, *shape[1:]]`` (a scalar gathers as a vector).
    """
    plan = _keep(_native.TfGatherPlan(engine, list(names), [d.num for d in dtypes],
                                      [d.itemsize for d in dtypes], fallback, record))
    outputs = library().keras_dist_allgather(list(tensors), plan=plan.id,
                                             entry=_native.tf_allgather_entry_address())
    for output, tensor in zip(outputs, tensors):
        output.set_shape([None, *tensor.shape[1:]])
    return list(outputs)


def gathered_alone(tensors: Sequence) -> list | None:
    """The values of an allgather over one rank (a scalar as a vector), with no
    op of keras_dist's in the step; None where a rank is unknown."""
    import tensorflow as tf

    if any(t.shape.rank is None for t in tensors):
        return None
    return [tf.reshape(t, [1]) if t.shape.rank == 0 else tf.identity(t) for t in tensors]


def identities(tensors: Sequence) -> list:
    """The values of a reduction over one rank, with no op of keras_dist's in the step."""
    import tensorflow as tf

    return [tf.identity(t) for t in tensors]


def as_arrays(raw: Sequence[np.ndarray], dtypes: Sequence[np.dtype],
              shapes: Sequence[tuple]) -> list[np.ndarray]:
    """The op's buffers (1-D uint8 arrays) as arrays of their dtypes and shapes."""
    return [r.view(d).reshape(s) for r, d, s in zip(raw, dtypes, shapes)]
