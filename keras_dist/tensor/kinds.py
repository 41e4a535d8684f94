"""What kind a user value is (numpy, Python scalar, Keras variable, TensorFlow
tensor eager or symbolic, JAX, torch or cupy array), and its conversions to
and from numpy. The frameworks are imported only once a value of theirs is
seen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np

from keras_dist.tensor.counters import COUNTERS


def is_tf(value) -> bool:
    return type(value).__module__.startswith("tensorflow")


def is_cupy(value) -> bool:
    return type(value).__module__.startswith("cupy")


def is_torch(value) -> bool:
    return type(value).__module__.startswith("torch")


def is_jax(value) -> bool:
    return type(value).__module__.startswith(("jax", "jaxlib"))


# Each framework's glue module, imported when first asked for (so the
# framework itself only once a value of its kind is seen).

def torch_glue():
    """The ``torch_glue`` module."""
    from keras_dist.tensor import torch_glue as glue

    return glue


def jax_glue():
    """The ``jax_glue`` module."""
    from keras_dist.tensor import jax_glue as glue

    return glue


def tf_glue():
    """The ``tf.glue`` module."""
    from keras_dist.tensor.tf import glue

    return glue


def is_indexed_slices(value) -> bool:
    """True for a TensorFlow ``IndexedSlices`` (a sparse gradient)."""
    return type(value).__name__ == "IndexedSlices" and is_tf(value)


def unwrap(value):
    """A Keras variable becomes its backend value; anything else is returned."""
    if type(value).__module__.startswith("keras") and hasattr(value, "value"):
        return value.value
    return value


def dtype_of(value) -> np.dtype:
    value = unwrap(value)
    if is_tf(value):
        return np.dtype(value.dtype.as_numpy_dtype)
    if is_torch(value):
        return torch_glue().numpy_dtype(value)
    if hasattr(value, "dtype"):
        return np.dtype(value.dtype)
    return np.asarray(value).dtype


def cast(value, dtype):
    value = unwrap(value)
    if is_tf(value):
        import tensorflow as tf

        return tf.cast(value, tf.as_dtype(dtype))
    if is_cupy(value) or is_jax(value):
        return value.astype(dtype)
    if is_torch(value):
        return torch_glue().cast(value, dtype)
    return np.asarray(value).astype(dtype)


def is_symbolic(value) -> bool:
    if not is_tf(value):
        return False
    import tensorflow as tf

    return not tf.executing_eagerly() or not hasattr(value, "numpy")


def executing_eagerly() -> bool:
    """False inside a ``tf.function`` or a TF1 graph; True without TensorFlow loaded."""
    import sys

    tf = sys.modules.get("tensorflow")
    return tf is None or tf.executing_eagerly()


def to_numpy(value) -> np.ndarray:
    value = unwrap(value)
    if is_tf(value):
        return value.numpy()
    if is_cupy(value):
        COUNTERS["device_to_host"] += 1
        return value.get()
    if is_torch(value):
        return torch_glue().to_numpy(value)
    if is_jax(value):
        return jax_glue().to_numpy(value)
    array = np.asarray(value)
    if array.dtype == object:
        raise TypeError(
            f"keras_dist collectives take numbers, arrays or tensors. Received: {type(value)}"
        )
    return array


def like(template, array: np.ndarray):
    """Returns ``array`` as the kind of value ``template`` is."""
    template = unwrap(template)
    if is_tf(template):
        import tensorflow as tf

        with tf.device(getattr(template, "device", None) or "/CPU:0"):
            return tf.convert_to_tensor(array)
    if is_cupy(template):
        import cupy

        with template.device:  # on the template's GPU, not the current one
            return cupy.asarray(array)
    if is_torch(template):
        return torch_glue().like(template, array)
    if is_jax(template):
        return jax_glue().like(template, array)
    if isinstance(template, np.ndarray):
        return array
    if np.ndim(template) == 0 and not isinstance(template, np.generic):
        return array.item()  # a Python scalar in, a Python scalar out
    return array[()] if array.ndim == 0 else array


def _read(variable):
    value = unwrap(variable)
    read_value = getattr(value, "read_value", None)
    return read_value() if callable(read_value) else value


def assign_and_read(variables: Sequence, values: Sequence | None) -> list:
    """Assigns ``values`` (None: nothing) to ``variables``; returns their values after.

    In a graph the reads depend on the assignments, so evaluating a read
    assigns first (TF1 graphs have no automatic ordering).
    """
    assignments = []
    for variable, value in zip(variables, values or ()):
        if is_tf(variable):  # a TF variable: its assign op, for the graph case
            assignments.append(variable.assign(value, read_value=False))
        else:  # a Keras variable converts and checks the value itself
            variable.assign(value)
    if executing_eagerly():
        return [_read(v) for v in variables]
    import tensorflow as tf

    with tf.control_dependencies([a for a in assignments if a is not None]):
        return [tf.identity(_read(v)) for v in variables]


def after(values: Sequence):
    """A context in which new TF ops run after ``values`` are computed.

    Several collectives made by one call must run in the same order on every
    rank; a TF1 graph, unlike eager code and ``tf.function``, would run
    independent ops in any order. A no-op unless ``values`` are symbolic.
    """
    symbolic = [v for v in values if is_symbolic(v)]
    if not symbolic:
        return contextlib.nullcontext()
    import tensorflow as tf

    return tf.control_dependencies(symbolic)


def group_op(values: Sequence):
    """One TF op that evaluates ``values``."""
    import tensorflow as tf

    return tf.group(*values)
