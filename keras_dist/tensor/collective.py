"""``Collective``: a collective's ways of running, the record ``conversions.run``
takes (and ``jax_glue.run_traced``). A leaf of the tensor layer, so that every
module naming it imports nothing else for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

#: ``grad(inputs, outputs, upstream) -> list``: the gradients with respect to
#: ``inputs`` (TF tensors), given those with respect to ``outputs``
#: (``upstream``, one per output, zeros where TF passed none). An entry may
#: be None (no gradient). Built from keras_dist collectives, it is itself
#: differentiable.
GradFn = Callable[[list, list, list], list]


@dataclasses.dataclass(frozen=True)
class Collective:
    """A collective's ways of running, for ``run``: its numpy function, and
    what else each execution context may take instead or beside it.

    Only ``numpy_fn`` and ``name`` are required; each other field, where
    left at its default, is not used.

    Attributes:
        numpy_fn: numpy arrays in, numpy arrays out.
        name: the collective, for the op's name.
        shapes: the static shapes of the outputs from the list of the inputs'
            ``tf.TensorShape`` (default: each output shaped as its input).
        out_dtypes: the outputs' dtypes (default: the inputs' dtypes, one
            output per input).
        grad: makes the op differentiable with TensorFlow (tapes,
            ``tf.gradients``); see ``GradFn``.
        device_fn: what ``numpy_fn`` does, on device arrays (cupy), same
            shapes and dtypes out; where given, GPU values take it without a
            host copy: eager torch, JAX and TF GPU tensors
            (``device_path``), JAX inside ``jax.jit`` on a GPU (a buffer
            callback), TF inside a ``tf.function`` when TensorFlow sees a GPU
            and cupy imports (a ``tf.py_function`` op whose tensors on a GPU
            take it, the others ``numpy_fn``). Used only where each output
            is shaped and typed as its input (``shapes`` and ``out_dtypes``
            not given).
        one_buffer: in a traced TF step (the ``numpy_function`` op), the
            outputs leave the op as one buffer, sliced apart in the graph
            (``_buffer_layout``): TensorFlow pays a fixed cost per output of
            that op. Cheapest when ``numpy_fn`` returns
            ``fusion.aligned_like`` views; other arrays are copied into one.
        graph_kernel: in a traced TF step on the host (not the device path),
            builds the op itself from the symbolic inputs instead of the
            ``numpy_function`` op (``tf.kernel``), or returns None.
        in_place: what ``numpy_fn`` does, leaving each result in its input
            array (same shapes and dtypes); where given, a traced JAX step on
            the CPU takes it on the buffers XLA hands the callback, each
            output the buffer of its input (``jax_glue.run_traced``). Used
            only where each output is shaped and typed as its input.
        xla_kernel: in a traced JAX step on the CPU, builds the step's call of
            keras_dist's XLA FFI handler from the traced inputs (outputs shaped
            and typed as the inputs) instead of the buffer callback, or
            returns None. Used only where each output is shaped and typed as
            its input.
    """

    numpy_fn: Callable[[list[np.ndarray]], list[np.ndarray]]
    name: str
    shapes: Callable[[list], list] | None = None
    out_dtypes: Sequence | None = None
    grad: GradFn | None = None
    device_fn: Callable[[list], list] | None = None
    one_buffer: bool = False
    graph_kernel: Callable[[list], list | None] | None = None
    in_place: Callable[[list], None] | None = None
    xla_kernel: Callable[[list], list | None] | None = None

    @property
    def outputs_like_inputs(self) -> bool:
        """True when each output is shaped and typed as its input (neither
        ``shapes`` nor ``out_dtypes`` given): only then do ``device_fn``,
        ``in_place`` and ``xla_kernel`` serve."""
        return self.shapes is None and self.out_dtypes is None
