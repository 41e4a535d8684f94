"""The bridge between user values and the tensor layer's numpy functions.

The collectives in ``ops`` see numpy arrays only. ``run`` is the one bridge
from a numpy function to TensorFlow (eager or graph execution, gradients,
the TensorFlow error classes a TF caller expects), JAX and the device path.
It uses, each from its own module: what kind a value is and its numpy
conversions (``kinds``), a collective's ways of running (``collective``), the
TensorFlow error classes (``tf.errors``), the device path (``device_path``)
and a traced step's outputs as one buffer (``tf.graph_buffer``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence

import numpy as np

from keras_dist import _compat
from keras_dist._runtime import context
from keras_dist.errors import CollectiveMismatchError
from keras_dist.tensor.collective import Collective, GradFn
from keras_dist.tensor.counters import COUNTERS
from keras_dist.tensor.device_path import device_path, run_on_device
from keras_dist.tensor.kinds import (
    is_jax,
    is_symbolic,
    is_tf,
    jax_glue,
    like,
    tf_glue,
    to_numpy,
    unwrap,
)
from keras_dist.tensor.tf.errors import FAILURE_PREFIX, SUCCESS, SUCCESS_OUT, as_tf_error
from keras_dist.tensor.tf.graph_buffer import buffer_layout, from_buffer, to_buffer

#: Per TF1 graph: the name of the collective op built last in it, which the
#: next one built waits for (``_after_previous_collective``); None while a
#: ``in_a_run_of_their_own`` block builds. A name, not the op: the op refers to
#: its graph, which would keep the key alive.
_LAST_COLLECTIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# ---------------------------------------------------------------------------
# The bridge.

def run(values: Sequence, collective: Collective) -> list:
    """Applies ``collective.numpy_fn`` to ``values``; TF values get a TF op,
    with a gradient.

    Eager values are converted to numpy and back (each output as the kind of
    value of the input at its position, or of the first input). Symbolic TF
    values (a ``tf.function`` or a TF1 graph) get one stateful
    ``tf.numpy_function`` op for the whole list, so the collective runs once
    per step, in program order. ``Collective`` says which of its other ways
    of running each context takes.

    Args:
        values: the inputs (any kind ``to_numpy`` takes).
        collective: the collective's ways of running.

    Returns:
        The outputs as a list.

    Raises:
        CollectiveMismatchError, ValueError, TypeError: as ``numpy_fn`` raises
            them; for TF values they are also the matching ``tf.errors``
            class (``as_tf_error``), in eager and graph execution alike.
    """
    values = [unwrap(v) for v in values]
    if any(is_jax(v) and jax_glue().is_traced(v) for v in values):
        return jax_glue().run_traced(values, collective)
    numpy_fn = collective.numpy_fn
    on_device = collective.device_fn if collective.outputs_like_inputs else None
    if not any(is_tf(v) for v in values):
        path = device_path(values) if on_device is not None else None
        if path is not None:
            return run_on_device(values, on_device, *path)
        arrays = numpy_fn([to_numpy(v) for v in values])
        return [like(values[min(i, len(values) - 1)], a) for i, a in enumerate(arrays)]
    import tensorflow as tf

    tensors = [tf.convert_to_tensor(v) for v in values]
    dtypes = ([tf.as_dtype(d) for d in collective.out_dtypes]
              if collective.out_dtypes is not None else [t.dtype for t in tensors])
    symbolic = any(is_symbolic(t) for t in tensors)

    def forward(*inputs):
        if symbolic:
            if not tf.compat.v1.executing_eagerly_outside_functions():
                group = context.get()
                tf_glue().number_gpus_as_sessions(group.local_rank, group.local_size)
            device = on_device if on_device and _tf_device_path_available() else None
            if collective.graph_kernel is not None and device is None:
                with _after_previous_collective() as remember:
                    built = collective.graph_kernel(list(inputs))
                    if built is not None:
                        remember(built[0].op)
                        return built
            return _graph_op(list(inputs), numpy_fn, collective.name, collective.shapes,
                             dtypes, device, collective.one_buffer)
        path = device_path(inputs) if on_device is not None else None
        try:
            if path is not None:
                return run_on_device(list(inputs), on_device, *path)
            arrays = numpy_fn(_tf_to_numpy(inputs))
        except (CollectiveMismatchError, ValueError, TypeError, NotImplementedError) as error:
            raise as_tf_error(error) from error
        return [_to_tensor(a, t) for a, t in zip(arrays, _templates(inputs, len(arrays)))]

    if collective.grad is None or not (symbolic or _compat.tape_may_record()):
        results = forward(*tensors)
    else:
        results = _differentiable(forward, collective.grad, len(dtypes))(*tensors)
    if symbolic:
        return results
    # Eagerly, each output is the kind of value its input was (numpy stays numpy).
    return [r if is_tf(v) else like(v, r.numpy())
            for r, v in zip(results, _templates(values, len(results)))]


def _tf_to_numpy(tensors: Sequence) -> list[np.ndarray]:
    """Eager TF tensors as numpy arrays (those in GPU memory counted as copies)."""
    COUNTERS["device_to_host"] += sum(1 for t in tensors if tf_glue().on_gpu(t))
    return [t.numpy() for t in tensors]


def _tf_device_path_available() -> bool:
    """True when a traced TF step may hand GPU tensors to cupy: the step is a
    ``tf.function`` of an eager program, TF sees a GPU and cupy imports (read
    when the step is traced).

    A TF1 graph (a session's) keeps the host path, the session copying GPU
    tensors to the op and back: asking TensorFlow's eager runtime for its
    GPUs would start it while the graph is built, before the session that
    ``visible_device_list`` pins numbers them (see
    ``tf.glue.number_gpus_as_sessions``), and a ``tf.py_function`` run by a
    session has not handed GPU tensors over on a GPU machine yet.
    """
    import tensorflow as tf

    if not tf.compat.v1.executing_eagerly_outside_functions():
        return False
    from keras_dist.tensor import gpu

    return tf_glue().gpu_visible() and gpu.usable_cupy() is not None


def _templates(inputs: Sequence, count: int) -> list:
    return [inputs[min(i, len(inputs) - 1)] for i in range(count)]


def _to_tensor(array: np.ndarray, template):
    import tensorflow as tf

    with tf.device(template.device or "/CPU:0"):
        return tf.convert_to_tensor(array)


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
    chained = (not isinstance(graph, _compat.func_graph_class())
               and _compat.control_flow_context(graph) is None)
    previous = _LAST_COLLECTIVE.get(graph) if chained else None

    def remember(op) -> None:
        if chained:
            _LAST_COLLECTIVE[graph] = op.name

    if previous is None:
        yield remember
        return
    with tf.control_dependencies([graph.get_operation_by_name(previous)]):
        yield remember


@contextlib.contextmanager
def in_a_run_of_their_own():
    """Collectives of a TF1 graph built inside are run by a ``session.run`` of
    their own (a broadcast of the variables at start): they neither wait for
    the collectives built before them nor make those built later wait, as
    ``_after_previous_collective`` chains the others. Chained, running a
    broadcast built after the train step would run the step too."""
    import tensorflow as tf

    graph = tf.compat.v1.get_default_graph()
    previous = _LAST_COLLECTIVE.get(graph)
    _LAST_COLLECTIVE[graph] = None
    try:
        yield
    finally:
        _LAST_COLLECTIVE[graph] = previous


def _graph_op(tensors: list, numpy_fn: Callable, name: str, shapes: Callable | None,
              dtypes: list, device_fn: Callable | None = None,
              one_buffer: bool = False) -> list:
    """``numpy_fn`` as one stateful graph op, failing as ``run`` says.

    Without ``device_fn``: a ``tf.numpy_function`` (with ``one_buffer``, its
    outputs leave it as one buffer: ``graph_buffer.buffer_layout``). With it: a
    ``tf.py_function``, which hands the function TF tensors on the op's
    device: on a GPU, they take ``device_fn`` by DLPack (``tf.glue`` says how
    it is ordered against TensorFlow's stream); elsewhere ``numpy_fn``.
    """
    import tensorflow as tf

    static = (shapes([t.shape for t in tensors]) if shapes
              else [t.shape for t in _templates(tensors, len(dtypes))])
    layout = (buffer_layout(dtypes, static) if one_buffer and device_fn is None else None)
    wire_dtypes = dtypes if layout is None else (
        [*layout.buffer_dtypes,
         *(d for d, inside in zip(dtypes, layout.in_buffer) if not inside)])

    def reduce(inputs: list) -> list:
        if device_fn is None:
            results = numpy_fn(inputs)
            return results if layout is None else to_buffer(results, layout)
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
            status = (FAILURE_PREFIX + f"keras_dist {type(error).__name__}: {error}")
            return [*results, np.bytes_(status.encode()[:3000])]
        return [*results, SUCCESS_OUT]

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
    if tf.compat.v1.executing_eagerly_outside_functions():
        # Only a failed step reads a file (and fails there); a good one skips it.
        check = tf.cond(tf.equal(status, SUCCESS), lambda: tf.constant(""),
                        lambda: tf.io.read_file(status, name=f"keras_dist_{name}_status"))
    else:
        # A TF1 graph reads the status every step (a good one: os.devnull, empty):
        # building a `tf.cond` there would start TensorFlow's eager runtime before
        # the session numbers the GPUs (see `tf.glue.number_gpus_as_sessions`).
        check = tf.io.read_file(status, name=f"keras_dist_{name}_status")
    # Graph optimisation drops stateless ops that feed only control edges:
    # the outputs wait on a (stateful, always true) assertion over its result.
    guard = tf.debugging.Assert(tf.strings.length(check) >= 0, [check])
    with tf.control_dependencies([guard]):
        wire = [tf.identity(o) for o in wire]
    outputs = wire if layout is None else from_buffer(wire, layout, dtypes, static)
    for output, shape in zip(outputs, static):
        output.set_shape(shape)
    return outputs
