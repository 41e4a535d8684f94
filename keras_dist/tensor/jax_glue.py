"""JAX arrays in the tensor layer, eager and inside ``jax.jit``.

Imported only when a JAX value reaches a collective. Eager arrays go to
numpy and back. Inside a traced function (Keras's jitted train step) a
collective becomes one ordered ``io_callback``: the host runs the numpy
function once per call of the compiled step, in program order, so every rank
runs its collectives in the same sequence, with or without XLA. Outputs of a
traced collective must have static shapes: collectives whose output shape
depends on other ranks (allgather, alltoall, ...) raise a clear error there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def is_traced(value) -> bool:
    return isinstance(value, jax.core.Tracer)


def to_numpy(array) -> np.ndarray:
    if is_traced(array):
        raise TypeError(
            "This keras_dist collective cannot run on a traced JAX array (inside jax.jit "
            "or a Keras train step on the JAX backend); call it outside the traced "
            "function. Received: a tracer of shape "
            f"{tuple(array.shape)} and dtype {array.dtype}")
    return np.asarray(array)


def like(template, array: np.ndarray):
    return jnp.asarray(array)


def run_traced(values: Sequence, numpy_fn: Callable, name: str,
               out_dtypes: Sequence | None, same_shapes: bool) -> list:
    """``numpy_fn`` on traced values as one ordered host callback."""
    if not same_shapes:
        raise NotImplementedError(
            f"keras_dist `{name}` on a traced JAX array needs a static output shape, which "
            "depends on the other ranks here: call it outside jax.jit (Keras's JAX train "
            "step is jitted). Received: a traced input of shape "
            f"{tuple(values[0].shape)}")
    values = [jnp.asarray(v) for v in values]
    dtypes = list(out_dtypes) if out_dtypes is not None else [v.dtype for v in values]
    results = [jax.ShapeDtypeStruct(v.shape, d) for v, d in zip(values, dtypes)]

    def host(*arrays):
        outputs = numpy_fn([np.asarray(a) for a in arrays])
        return tuple(np.asarray(o, dtype=r.dtype).reshape(r.shape)
                     for o, r in zip(outputs, results))

    from jax.experimental import io_callback

    return list(io_callback(host, tuple(results), *values, ordered=True))
