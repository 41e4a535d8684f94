"""How a traced TensorFlow step's ``numpy_function`` outputs leave it as one buffer,
sliced apart in the graph (a ``collective.Collective``'s ``one_buffer``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from keras_dist.tensor import fusion

#: Outputs up to this size leave a traced step's ``numpy_function`` in one
#: buffer; larger ones alone. A slice of the buffer shares its memory (when it
#: starts and ends on ``fusion.ALIGN_BYTES`` boundaries; else TensorFlow copies
#: it), so the op that consumes it cannot take it over as its own output
#: (TensorFlow's in-place forwarding needs the only reference) and allocates,
#: which costs large outputs more than they gain. Small outputs gain the fixed
#: cost TensorFlow pays per output of the op and lose next to nothing.
IN_BUFFER_MAX_BYTES = 64 << 10


class BufferLayout(NamedTuple):
    """How a traced step's ``numpy_function`` outputs leave it in one buffer."""

    #: Where each output starts in the buffer (``fusion.aligned_offsets``).
    offsets: list[int]
    #: The bytes the buffer spans.
    total: int
    #: Each output's bytes.
    nbytes: list[int]
    #: Whether each output is in the buffer.
    in_buffer: list[bool]
    #: The dtypes the buffer leaves the op as (those of the outputs it holds).
    buffer_dtypes: list


def buffer_layout(dtypes: list, shapes: list) -> BufferLayout | None:
    """Which outputs of a traced step's ``numpy_function`` leave it in one
    buffer laid out as ``fusion.aligned_like`` lays out arrays of these shapes
    and dtypes (a ``BufferLayout``), or None (a shape unknown when tracing, or fewer than two
    outputs would share). The buffer leaves the op once per dtype among the
    outputs it holds (views of the same bytes), so that each output is a
    slice and a reshape in the graph, without a bitcast."""
    import tensorflow as tf

    if not all(shape.is_fully_defined() for shape in shapes):
        return None
    nbytes = [shape.num_elements() * dtype.size for shape, dtype in zip(shapes, dtypes)]
    offsets, total = fusion.aligned_offsets(nbytes)
    numbers = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.int16, tf.int32,
               tf.int64, tf.uint8, tf.uint16, tf.uint32, tf.uint64, tf.complex64,
               tf.complex128)
    in_buffer = [dtype in numbers and size <= IN_BUFFER_MAX_BYTES
                 for dtype, size in zip(dtypes, nbytes)]
    if sum(in_buffer) < 2:
        return None
    buffer_dtypes = list(dict.fromkeys(d for d, inside in zip(dtypes, in_buffer) if inside))
    return BufferLayout(offsets, total, nbytes, in_buffer, buffer_dtypes)


def to_buffer(results: list, layout: BufferLayout) -> list:
    """A numpy function's results as they leave the op: the buffer (``region``
    of ``fusion.aligned_like`` views, else a copy of the results it holds) as
    each of its dtypes, then the others."""
    _, total, _, in_buffer, buffer_dtypes = layout
    region = getattr(results, "region", None)
    if region is None or region.nbytes != total:
        views = fusion.aligned_like(results)
        for view, result, inside in zip(views, results, in_buffer):
            if inside:  # the others leave the op as they are
                np.copyto(view, result)
        region = views.region
    return [*(region.view(dtype.as_numpy_dtype) for dtype in buffer_dtypes),
            *(r for r, inside in zip(results, in_buffer) if not inside)]


def from_buffer(wire: list, layout: BufferLayout, dtypes: list, shapes: list) -> list:
    """The graph's outputs from what left the op (``to_buffer``): slices of the
    buffer, which share its memory where they start and end aligned."""
    import tensorflow as tf

    offsets, total, nbytes, in_buffer, buffer_dtypes = layout
    typed = dict(zip(buffer_dtypes, wire))
    for dtype, region in typed.items():
        region.set_shape([total // dtype.size])
    others = iter(wire[len(buffer_dtypes):])
    outputs = []
    for offset, size, inside, dtype, shape in zip(offsets, nbytes, in_buffer, dtypes, shapes):
        if inside:
            piece = tf.slice(typed[dtype], [offset // dtype.size], [size // dtype.size])
            outputs.append(piece if shape.rank == 1 else tf.reshape(piece, shape))
        else:
            outputs.append(next(others))
    return outputs
