"""Conversions between user values (numpy, Python scalars, Keras variables,
TensorFlow tensors eager or symbolic, cupy arrays) and numpy buffers.

Framework-specific code of the tensor layer lives here: the collectives in
``ops`` see numpy arrays only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def is_tf(value) -> bool:
    return type(value).__module__.startswith("tensorflow")


def is_cupy(value) -> bool:
    return type(value).__module__.startswith("cupy")


def unwrap(value):
    """A Keras variable becomes its backend value; anything else is returned."""
    if type(value).__module__.startswith("keras") and hasattr(value, "value"):
        return value.value
    return value


def dtype_of(value) -> np.dtype:
    value = unwrap(value)
    if is_tf(value):
        return np.dtype(value.dtype.as_numpy_dtype)
    if hasattr(value, "dtype"):
        return np.dtype(value.dtype)
    return np.asarray(value).dtype


def cast(value, dtype):
    value = unwrap(value)
    if is_tf(value):
        import tensorflow as tf

        return tf.cast(value, tf.as_dtype(dtype))
    if is_cupy(value):
        return value.astype(dtype)
    return np.asarray(value).astype(dtype)


def is_symbolic(value) -> bool:
    if not is_tf(value):
        return False
    import tensorflow as tf

    return not tf.executing_eagerly() or not hasattr(value, "numpy")


def to_numpy(value) -> np.ndarray:
    value = unwrap(value)
    if is_tf(value):
        return value.numpy()
    if is_cupy(value):
        return value.get()
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

        with tf.device(template.device or "/CPU:0"):
            return tf.convert_to_tensor(array)
    if is_cupy(template):
        import cupy

        return cupy.asarray(array)
    if isinstance(template, np.ndarray):
        return array
    if np.ndim(template) == 0 and not isinstance(template, np.generic):
        return array.item()  # a Python scalar in, a Python scalar out
    return array[()] if array.ndim == 0 else array


def run(values: Sequence, numpy_fn: Callable[[list[np.ndarray]], list[np.ndarray]],
         name: str, shapes: Callable | None = None) -> list:
    """Applies ``numpy_fn`` to ``values``, in a TF graph when they are symbolic.

    Eager values are converted to numpy and back. Symbolic TF values (inside a
    ``tf.function``) get one stateful ``tf.numpy_function`` op for the whole
    list, so the collective runs once per step, in program order.
    """
    values = [unwrap(v) for v in values]
    if any(is_symbolic(v) for v in values):
        import tensorflow as tf

        tensors = [tf.convert_to_tensor(v) for v in values]
        outputs = tf.numpy_function(
            lambda *arrays: numpy_fn(list(arrays)),
            tensors,
            Tout=[t.dtype for t in tensors],
            stateful=True,
            name=f"keras_dist_{name}",
        )
        for tensor, output in zip(tensors, outputs):
            output.set_shape(shapes(tensor.shape) if shapes else tensor.shape)
        return list(outputs)
    arrays = numpy_fn([to_numpy(v) for v in values])
    return [like(v, a) for v, a in zip(values, arrays)]
