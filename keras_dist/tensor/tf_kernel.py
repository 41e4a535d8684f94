"""The grouped allreduce of a traced TensorFlow step as keras_dist's own op.

``KerasDistAllreduce`` (``native/src/tf_kernel.cc``, loaded with
``tf.load_op_library``) hands its input and output buffers to the native
module, which reduces each bucket with the shm engine straight from
TensorFlow's inputs into the outputs: each input's own buffer where
TensorFlow lets the op reuse it (a fresh gradient), else memory the op reuses
from step to step. Nothing runs in Python on a good step but one count in ``COUNTERS``
(and, while a timeline records, the collective's span). The
``tf.numpy_function`` op it replaces cost 0.2-0.9 ms a step in TensorFlow's
hand-over to Python (``benchmarks/tf_op_ab.py``).

A bucket the engine raises on goes to the fallback ``ops`` gives for that
bucket, in Python, as the numpy path does it (``ops._parts_mismatched``):
ranks that have joined, or an error (the op's status: a
``CollectiveMismatchError`` as FAILED_PRECONDITION, as on the numpy path).

Used when the op library loads (it is built with the native module, without
TensorFlow), the group runs on the shm engine, the call reduces with no
scale, and every shape is known when the step is traced; otherwise, or with
``KERAS_DIST_TF_OP=0``, the step keeps the ``tf.numpy_function`` op. In a
group of one rank such a call is ``identities``: no op at all.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence

import numpy as np

from keras_dist import _native

_OP_LIBRARY = "_tf_ops.so"

#: TensorFlow status codes for the errors a bucket's fallback raises.
_INVALID_ARGUMENT, _UNKNOWN, _FAILED_PRECONDITION, _UNIMPLEMENTED = 3, 2, 9, 12


def enabled() -> bool:
    """False when ``KERAS_DIST_TF_OP`` is ``0`` (or ``false``/``off``): the numpy path."""
    return os.environ.get("KERAS_DIST_TF_OP", "1").strip().lower() not in ("0", "false", "off",
                                                                            "no")


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


def allreduce(tensors: Sequence, engine, buckets: list, op_code: int, average: bool,
              fallback: Callable, record: Callable) -> list:
    """``KerasDistAllreduce`` of ``tensors`` (symbolic, every shape known).

    Args:
        engine: the group's ``_native.ShmEngine``.
        buckets: ``[(indices into tensors, dtype code, name peers check)]``.
        op_code: the engine's op; ``average`` divides a sum by the group's size.
        fallback: ``fallback(bucket, srcs, dsts, error)`` as ``_native.TfPlan`` calls it.
        record: ``record(start_ns, end_ns, wait_ns)`` while a timeline records.

    Returns:
        The outputs, shaped as the inputs.
    """
    import tensorflow as tf

    nbytes = [t.shape.num_elements() * t.dtype.size for t in tensors]
    plan = _native.TfPlan(engine, buckets, op_code, average, nbytes, fallback, record)
    # The graph keeps the plan alive as long as the op can run.
    graph = tf.compat.v1.get_default_graph()
    if not hasattr(graph, "_keras_dist_plans"):
        graph._keras_dist_plans = []  # noqa: SLF001
    graph._keras_dist_plans.append(plan)  # noqa: SLF001
    outputs = library().keras_dist_allreduce(list(tensors), plan=plan.id,
                                             entry=_native.tf_entry_address())
    for output, tensor in zip(outputs, tensors):
        output.set_shape(tensor.shape)
    return list(outputs)


def identities(tensors: Sequence) -> list:
    """The values of a reduction over one rank, with no op of keras_dist's in the step."""
    import tensorflow as tf

    return [tf.identity(t) for t in tensors]


def as_arrays(raw: Sequence[np.ndarray], dtypes: Sequence[np.dtype],
              shapes: Sequence[tuple]) -> list[np.ndarray]:
    """The op's buffers (1-D uint8 arrays) as arrays of their dtypes and shapes."""
    return [r.view(d).reshape(s) for r, d, s in zip(raw, dtypes, shapes)]
