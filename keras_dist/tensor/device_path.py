"""The device path: GPU tensors handed over by DLPack, no host copy.

Each framework's glue module (``torch_glue``, ``jax_glue``, ``tf.glue``) has
``device_module(values)`` (cupy when the values can take the device path,
else None), ``device_scope(values, xp)`` (cupy's device and stream for
them), ``to_device_arrays(values, xp)`` and ``from_device_arrays(arrays,
templates, xp)``; where the framework needs a synchronisation, the last two
make it once per call. ``xp`` is cupy on a GPU; the CPU tests pass numpy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from keras_dist.tensor.kinds import (
    is_jax,
    is_symbolic,
    is_tf,
    is_torch,
    jax_glue,
    tf_glue,
    torch_glue,
)


def device_path(values: Sequence):
    """The glue module and array module for ``values`` on the device path, or None.

    Eager values only, all of one framework (torch, JAX or TensorFlow), each
    on a GPU, of a dtype the device path carries, with cupy importable.
    """
    if not values:
        return None
    if all(is_torch(v) for v in values):
        glue = torch_glue()
    elif all(is_jax(v) and not jax_glue().is_traced(v) for v in values):
        glue = jax_glue()
    elif all(is_tf(v) and not is_symbolic(v) for v in values):
        glue = tf_glue()
    else:
        return None
    xp = glue.device_module(values)
    return None if xp is None else (glue, xp)


def run_on_device(values: Sequence, device_fn: Callable[[list], list], glue, xp) -> list:
    """``device_fn`` (device arrays in and out) on framework ``values``, by DLPack.

    An output that is its input array comes back as the input value itself.
    """
    with glue.device_scope(values, xp):
        arrays = glue.to_device_arrays(values, xp)
        results = device_fn(arrays)
        changed = [i for i, (r, a) in enumerate(zip(results, arrays)) if r is not a]
        converted = glue.from_device_arrays([results[i] for i in changed],
                                            [values[i] for i in changed], xp)
    outputs = list(values)
    for index, value in zip(changed, converted):
        outputs[index] = value
    return outputs
