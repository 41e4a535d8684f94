"""Conversions between user values (numpy, Python scalars, Keras variables,
TensorFlow tensors eager or symbolic, cupy arrays) and numpy buffers.

Framework-specific code of the tensor layer lives here: the collectives in
``ops`` see numpy arrays only. ``run`` is the one bridge from a numpy
function to TensorFlow: eager or graph execution, gradients, and the
TensorFlow error classes a TF caller expects.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Sequence

import numpy as np

from keras_dist.errors import CollectiveMismatchError
from keras_dist.tensor import fusion
from keras_dist.tensor.counters import COUNTERS


def is_tf(value) -> bool:
    return type(value).__module__.startswith("tensorflow")


def is_cupy(value) -> bool:
    return type(value).__module__.startswith("cupy")


def is_torch(value) -> bool:
    return type(value).__module__.startswith("torch")


def is_jax(value) -> bool:
    return type(value).__module__.startswith(("jax", "jaxlib"))


def _torch():
    from keras_dist.tensor import torch_glue

    return torch_glue


def _jax():
    from keras_dist.tensor import jax_glue

    return jax_glue


def _tf():
    from keras_dist.tensor import tf_glue

    return tf_glue


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
        return _torch().numpy_dtype(value)
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
        return _torch().cast(value, dtype)
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
        return _torch().to_numpy(value)
    if is_jax(value):
        return _jax().to_numpy(value)
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
        return _torch().like(template, array)
    if is_jax(template):
        return _jax().like(template, array)
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


# ---------------------------------------------------------------------------
# TensorFlow error classes.
#
# A TF caller catches ``tf.errors.OpError`` subclasses: a mismatch between
# ranks is a ``FailedPreconditionError``, a bad argument an
# ``InvalidArgumentError``. Eagerly, keras_dist raises classes that are both
# its own error and the TF one. Inside a graph, TF itself builds the error
# from a status code when the step fails: ``numpy_function`` turns a Python
# ``ValueError``/``TypeError`` into INVALID_ARGUMENT and a
# ``NotImplementedError`` into UNIMPLEMENTED, but any other exception into
# UNKNOWN, whatever its class. So a mismatch inside a graph leaves the numpy
# function normally and hands its message to a ``ReadFile`` op: reading a
# path below ``os.devnull`` fails with FAILED_PRECONDITION ("Not a
# directory"), and the message travels as that path. When nothing failed the
# status is ``os.devnull`` itself and the graph skips the read.

_FAILURE_PREFIX = os.devnull + "/"
_SUCCESS = np.bytes_(os.devnull.encode())
# What a good step's numpy function returns as its status: TensorFlow passes
# a 0-d object array of bytes through as it is, where a bytes scalar costs it
# a second conversion (9 us a step, measured with FuncRegistry._convert).
_SUCCESS_OUT = np.array(_SUCCESS, dtype=object)


def _tf_error_class(error: BaseException):
    """The TF ``OpError`` class matching ``error``, or None."""
    import tensorflow as tf

    if isinstance(error, CollectiveMismatchError):
        return tf.errors.FailedPreconditionError
    if isinstance(error, (ValueError, TypeError)):
        return tf.errors.InvalidArgumentError
    if isinstance(error, NotImplementedError):
        return tf.errors.UnimplementedError
    return None


@functools.cache
def _dual_class(error_class: type, tf_class: type) -> type:
    """A class that is both ``error_class`` and ``tf_class``, named as ``error_class``."""

    def __init__(self, message: str, state: dict) -> None:
        tf_class.__init__(self, None, None, message)
        self.args = (message,)
        self.__dict__.update(state)

    def __reduce__(self):  # travels as the keras_dist error alone
        plain = error_class.__new__(error_class)
        plain.args = self.args
        plain.__dict__.update({k: v for k, v in vars(self).items() if not k.startswith("_")})
        return plain.__reduce__()

    return type(error_class.__name__, (error_class, tf_class), {
        "__init__": __init__, "__reduce__": __reduce__,
        "__module__": error_class.__module__, "__qualname__": error_class.__qualname__,
        "__str__": BaseException.__str__,
    })


def as_tf_error(error: BaseException) -> BaseException:
    """``error`` as an instance that is also the matching TF ``OpError``.

    Errors with no TF counterpart, and those that already are one, are
    returned as they are.
    """
    import tensorflow as tf

    tf_class = _tf_error_class(error)
    if tf_class is None or isinstance(error, tf.errors.OpError):
        return error
    state = {k: v for k, v in vars(error).items() if not k.startswith("_")}  # e.g. peer_rank
    dual = _dual_class(type(error), tf_class)(str(error), state)
    dual.__traceback__ = error.__traceback__
    return dual


def not_converted_by_autograph(function: Callable) -> Callable:
    """Marks ``function`` so that a ``tf.function`` calls it as plain Python.

    AutoGraph rewrites the Python code a ``tf.function`` calls, module by
    module, unless told otherwise; keras_dist's own code builds its graph ops
    itself and must run as written (a rewritten call can fail while tracing).
    TF's ``do_not_convert`` decorator marks a function with this attribute;
    setting it directly keeps TensorFlow out of this module's import.
    """
    function.autograph_info__ = frozenset()
    return function


def raising_tf_errors(function: Callable) -> Callable:
    """Decorates a collective: when any argument is a TF value, its errors are
    raised as ``as_tf_error`` makes them (checks made before ``run`` included).
    The collective runs unconverted inside a ``tf.function``
    (``not_converted_by_autograph``)."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except (CollectiveMismatchError, ValueError, TypeError, NotImplementedError) as error:
            if not _mentions_tf(args) and not _mentions_tf(kwargs.values()):
                raise
            raise as_tf_error(error) from error.__cause__

    return not_converted_by_autograph(wrapper)


def _mentions_tf(values) -> bool:
    for value in values:
        if isinstance(value, (list, tuple)):
            if any(is_tf(unwrap(v)) for v in value):
                return True
        elif is_tf(unwrap(value)):
            return True
    return False


# ---------------------------------------------------------------------------
# The device path: GPU tensors handed over by DLPack, no host copy.
#
# Each framework's glue module (``torch_glue``, ``jax_glue``, ``tf_glue``) has
# ``device_module(values)`` (cupy when the values can take the device path,
# else None), ``device_scope(values, xp)`` (cupy's device and stream for
# them), ``to_device_arrays(values, xp)`` and ``from_device_arrays(arrays,
# templates, xp)``; where the framework needs a synchronisation, the last two
# make it once per call. ``xp`` is cupy on a GPU; the CPU tests pass numpy.


def device_path(values: Sequence):
    """The glue module and array module for ``values`` on the device path, or None.

    Eager values only, all of one framework (torch, JAX or TensorFlow), each
    on a GPU, of a dtype the device path carries, with cupy importable.
    """
    if not values:
        return None
    if all(is_torch(v) for v in values):
        glue = _torch()
    elif all(is_jax(v) and not _jax().is_traced(v) for v in values):
        glue = _jax()
    elif all(is_tf(v) and not is_symbolic(v) for v in values):
        glue = _tf()
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


# ---------------------------------------------------------------------------
# The bridge.

#: ``grad(inputs, outputs, upstream) -> list``: the gradients with respect to
#: ``inputs`` (TF tensors), given those with respect to ``outputs``
#: (``upstream``, one per output, zeros where TF passed none). An entry may
#: be None (no gradient). Built from keras_dist collectives, it is itself
#: differentiable.
GradFn = Callable[[list, list, list], list]


def run(values: Sequence, numpy_fn: Callable[[list[np.ndarray]], list[np.ndarray]],
        name: str, shapes: Callable[[list], list] | None = None, grad: GradFn | None = None,
        out_dtypes: Sequence | None = None,
        device_fn: Callable[[list], list] | None = None, one_buffer: bool = False,
        graph_kernel: Callable[[list], list | None] | None = None,
        in_place: Callable[[list], None] | None = None,
        xla_kernel: Callable[[list], list | None] | None = None) -> list:
    """Applies ``numpy_fn`` to ``values``; TF values get a TF op, with a gradient.

    Eager values are converted to numpy and back (each output as the kind of
    value of the input at its position, or of the first input). Symbolic TF
    values (a ``tf.function`` or a TF1 graph) get one stateful
    ``tf.numpy_function`` op for the whole list, so the collective runs once
    per step, in program order.

    Args:
        values: the inputs (any kind ``to_numpy`` takes).
        numpy_fn: numpy arrays in, numpy arrays out.
        name: the collective, for the op's name.
        shapes: the static shapes of the outputs from the list of the inputs'
            ``tf.TensorShape`` (default: each output shaped as its input).
        grad: makes the op differentiable with TensorFlow (tapes,
            ``tf.gradients``); see ``GradFn``.
        out_dtypes: the outputs' dtypes (default: the inputs' dtypes, one
            output per input).
        device_fn: what ``numpy_fn`` does, on device arrays (cupy), same
            shapes and dtypes out; where given, GPU values take it without a
            host copy: eager torch, JAX and TF GPU tensors
            (``device_path``), JAX inside ``jax.jit`` on a GPU (a buffer
            callback), TF inside a ``tf.function`` when TensorFlow sees a GPU
            and cupy imports (a ``tf.py_function`` op whose tensors on a GPU
            take it, the others ``numpy_fn``).
        one_buffer: in a traced TF step (the ``numpy_function`` op), the
            outputs leave the op as one buffer, sliced apart in the graph
            (``_buffer_layout``): TensorFlow's fixed cost per output of that
            op is about 10 us. Cheapest when ``numpy_fn`` returns
            ``fusion.aligned_like`` views; other arrays are copied into one.
        graph_kernel: in a traced TF step on the host (not the device path),
            builds the op itself from the symbolic inputs instead of the
            ``numpy_function`` op (``tf_kernel``), or returns None.
        in_place: what ``numpy_fn`` does, leaving each result in its input
            array (same shapes and dtypes); where given, a traced JAX step on
            the CPU takes it on the buffers XLA hands the callback, each
            output the buffer of its input (``jax_glue.run_traced``).
        xla_kernel: in a traced JAX step on the CPU, builds the step's call of
            keras_dist's XLA FFI handler from the traced inputs (outputs shaped
            and typed as the inputs) instead of the buffer callback, or
            returns None.

    Returns:
        The outputs as a list.

    Raises:
        CollectiveMismatchError, ValueError, TypeError: as ``numpy_fn`` raises
            them; for TF values they are also the matching ``tf.errors``
            class (``as_tf_error``), in eager and graph execution alike.
    """
    values = [unwrap(v) for v in values]
    if any(is_jax(v) and _jax().is_traced(v) for v in values):
        same_shapes = shapes is None and (out_dtypes is None or len(out_dtypes) == len(values))
        same_outputs = same_shapes and out_dtypes is None
        return _jax().run_traced(values, numpy_fn, name, out_dtypes, same_shapes,
                                 device_fn if same_shapes else None,
                                 in_place if same_outputs else None,
                                 xla_kernel if same_outputs else None)
    same_outputs = shapes is None and out_dtypes is None
    if not any(is_tf(v) for v in values):
        path = device_path(values) if device_fn is not None and same_outputs else None
        if path is not None:
            return run_on_device(values, device_fn, *path)
        arrays = numpy_fn([to_numpy(v) for v in values])
        return [like(values[min(i, len(values) - 1)], a) for i, a in enumerate(arrays)]
    import tensorflow as tf

    tensors = [tf.convert_to_tensor(v) for v in values]
    dtypes = ([tf.as_dtype(d) for d in out_dtypes] if out_dtypes is not None
              else [t.dtype for t in tensors])
    symbolic = any(is_symbolic(t) for t in tensors)

    on_device = device_fn if device_fn is not None and same_outputs else None

    def forward(*inputs):
        if symbolic:
            device = on_device if on_device and _tf_device_path_available() else None
            if graph_kernel is not None and device is None:
                with _after_previous_collective() as remember:
                    built = graph_kernel(list(inputs))
                    if built is not None:
                        remember(built[0].op)
                        return built
            return _graph_op(list(inputs), numpy_fn, name, shapes, dtypes, device, one_buffer)
        path = device_path(inputs) if on_device is not None else None
        try:
            if path is not None:
                return run_on_device(list(inputs), on_device, *path)
            arrays = numpy_fn(_tf_to_numpy(inputs))
        except (CollectiveMismatchError, ValueError, TypeError, NotImplementedError) as error:
            raise as_tf_error(error) from error
        return [_to_tensor(a, t) for a, t in zip(arrays, _templates(inputs, len(arrays)))]

    if grad is None or not (symbolic or _tape_may_record()):
        results = forward(*tensors)
    else:
        results = _differentiable(forward, grad, len(dtypes))(*tensors)
    if symbolic:
        return results
    # Eagerly, each output is the kind of value its input was (numpy stays numpy).
    return [r if is_tf(v) else like(v, r.numpy())
            for r, v in zip(results, _templates(values, len(results)))]


def _tf_to_numpy(tensors: Sequence) -> list[np.ndarray]:
    """Eager TF tensors as numpy arrays (those in GPU memory counted as copies)."""
    COUNTERS["device_to_host"] += sum(1 for t in tensors if _tf().on_gpu(t))
    return [t.numpy() for t in tensors]


def _tf_device_path_available() -> bool:
    """True when a traced TF step may hand GPU tensors to cupy: TF sees a GPU and
    cupy imports (read when the step is traced)."""
    from keras_dist.tensor import gpu

    return _tf().gpu_visible() and gpu.usable_cupy() is not None


def _templates(inputs: Sequence, count: int) -> list:
    return [inputs[min(i, len(inputs) - 1)] for i in range(count)]


def _to_tensor(array: np.ndarray, template):
    import tensorflow as tf

    with tf.device(template.device or "/CPU:0"):
        return tf.convert_to_tensor(array)


def _tape_may_record() -> bool:
    try:
        from tensorflow.python.eager import record
    except ImportError:  # pragma: no cover - a TF without it: assume a tape
        return True
    return record.could_possibly_record()


def _differentiable(forward: Callable, grad: GradFn, n_outputs: int) -> Callable:
    import tensorflow as tf

    @tf.custom_gradient
    def op(*inputs):
        outputs = forward(*inputs)

        def backward(*upstream):
            upstream = [tf.zeros_like(o) if u is None else u
                        for u, o in zip(upstream, outputs)]
            grads = list(grad(list(inputs), list(outputs), upstream))
            grads = [None if g is None or not (x.dtype.is_floating or x.dtype.is_complex)
                     else g for g, x in zip(grads, inputs)]
            return grads if len(grads) != 1 else grads[0]

        return (outputs if n_outputs != 1 else outputs[0]), backward

    def call(*inputs):
        result = op(*inputs)
        return list(result) if n_outputs != 1 else [result]

    return call


@contextlib.contextmanager
def _after_previous_collective():
    """Orders the collectives of a TF1 graph as they were built.

    A ``tf.function`` runs stateful ops in program order, but a TF1 graph run
    by a session runs independent ops in any order, which differs between
    ranks, and every rank must call the collectives in the same order. In a
    TF1 graph (outside its control-flow constructs), each collective op gets
    a control edge from the one built before it; the context yields the
    function that records the new op.
    """
    import tensorflow as tf

    graph = tf.compat.v1.get_default_graph()
    chained = (not isinstance(graph, _func_graph_class())
               and graph._get_control_flow_context() is None)  # noqa: SLF001
    previous = getattr(graph, "_keras_dist_last_collective", None) if chained else None

    def remember(op) -> None:
        if chained:
            graph._keras_dist_last_collective = op  # noqa: SLF001

    if previous is None:
        yield remember
        return
    with tf.control_dependencies([previous]):
        yield remember


@functools.cache
def _func_graph_class() -> type:
    from tensorflow.python.framework.func_graph import FuncGraph

    return FuncGraph


#: Outputs up to this size leave a traced step's ``numpy_function`` in one
#: buffer; larger ones alone. A slice of the buffer shares its memory (when it
#: starts and ends on ``fusion.ALIGN_BYTES`` boundaries; else TensorFlow copies
#: it), so the op that consumes it cannot take it over as its own output
#: (TensorFlow's in-place forwarding needs the only reference) and allocates:
#: measured in training, 0.3 ms a step more for the MLP's 2.7 MB of gradients
#: all in the buffer than all alone. Small outputs gain the ~10 us TensorFlow
#: spends per output of the op and lose next to nothing.
_IN_BUFFER_MAX_BYTES = 64 << 10


def _buffer_layout(dtypes: list, shapes: list) -> tuple | None:
    """Which outputs of a traced step's ``numpy_function`` leave it in one
    buffer laid out as ``fusion.aligned_like`` lays out arrays of these shapes
    and dtypes: ``(offsets, total bytes, bytes, in_buffer flags, the buffer's
    dtypes)``, or None (a shape unknown when tracing, or fewer than two
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
    in_buffer = [dtype in numbers and size <= _IN_BUFFER_MAX_BYTES
                 for dtype, size in zip(dtypes, nbytes)]
    if sum(in_buffer) < 2:
        return None
    buffer_dtypes = list(dict.fromkeys(d for d, inside in zip(dtypes, in_buffer) if inside))
    return offsets, total, nbytes, in_buffer, buffer_dtypes


def _to_buffer(results: list, layout: tuple) -> list:
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


def _from_buffer(wire: list, layout: tuple, dtypes: list, shapes: list) -> list:
    """The graph's outputs from what left the op (``_to_buffer``): slices of the
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


def _graph_op(tensors: list, numpy_fn: Callable, name: str, shapes: Callable | None,
              dtypes: list, device_fn: Callable | None = None,
              one_buffer: bool = False) -> list:
    """``numpy_fn`` as one stateful graph op, failing as ``run`` says.

    Without ``device_fn``: a ``tf.numpy_function`` (with ``one_buffer``, its
    outputs leave it as one buffer: ``_buffer_layout``). With it: a
    ``tf.py_function``, which hands the function TF tensors on the op's
    device: on a GPU, they take ``device_fn`` by DLPack (``tf_glue`` says how
    it is ordered against TensorFlow's stream); elsewhere ``numpy_fn``.
    """
    import tensorflow as tf

    static = (shapes([t.shape for t in tensors]) if shapes
              else [t.shape for t in _templates(tensors, len(dtypes))])
    layout = (_buffer_layout(dtypes, static) if one_buffer and device_fn is None else None)
    wire_dtypes = dtypes if layout is None else (
        [*layout[4], *(d for d, inside in zip(dtypes, layout[3]) if not inside)])

    def reduce(inputs: list) -> list:
        if device_fn is None:
            results = numpy_fn(inputs)
            return results if layout is None else _to_buffer(results, layout)
        path = device_path(inputs)
        if path is not None:
            return run_on_device(inputs, device_fn, *path)
        return numpy_fn(_tf_to_numpy(inputs))

    def call(*arrays):
        try:
            results = reduce(list(arrays))
        except CollectiveMismatchError as error:
            # Outputs of the right dtypes for the op to finish; the ReadFile
            # op below fails the step before anything reads them.
            results = [np.zeros(0, dtype.as_numpy_dtype) for dtype in wire_dtypes]
            status = (_FAILURE_PREFIX + f"keras_dist {type(error).__name__}: {error}")
            return [*results, np.bytes_(status.encode()[:3000])]
        return [*results, _SUCCESS_OUT]

    with _after_previous_collective() as remember:
        if device_fn is None:
            *wire, status = tf.numpy_function(
                call, tensors, Tout=[*wire_dtypes, tf.string], stateful=True,
                name=f"keras_dist_{name}")
        else:
            *wire, status = tf.py_function(
                call, tensors, Tout=[*wire_dtypes, tf.string], name=f"keras_dist_{name}")
        remember(status.op)
    status.set_shape(())
    # Only a failed step reads a file (and fails there); a good one skips it.
    check = tf.cond(tf.equal(status, _SUCCESS), lambda: tf.constant(""),
                    lambda: tf.io.read_file(status, name=f"keras_dist_{name}_status"))
    # Graph optimisation drops stateless ops that feed only control edges:
    # the outputs wait on a (stateful, always true) assertion over its result.
    guard = tf.debugging.Assert(tf.strings.length(check) >= 0, [check])
    with tf.control_dependencies([guard]):
        wire = [tf.identity(o) for o in wire]
    outputs = wire if layout is None else _from_buffer(wire, layout, dtypes, static)
    for output, shape in zip(outputs, static):
        output.set_shape(shape)
    return outputs
