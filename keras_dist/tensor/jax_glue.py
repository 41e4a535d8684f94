"""JAX arrays in the tensor layer, eager and inside ``jax.jit``.

Imported only when a JAX value reaches a collective. Eager arrays go to
numpy and back. Inside a traced function (Keras's jitted train step) on the
CPU, an unscaled allreduce of a group on one machine's shm engine is a call
of keras_dist's XLA FFI handler (``native_allreduce``), which reduces XLA's
buffers in place with no Python. Any other collective there becomes one
``jax.experimental.buffer_callback``: XLA hands
the callback its input and output buffers, which the numpy function reads
and fills as numpy views of the same memory, once per call of the compiled
step; each callback traced in a function takes an output of the one before
it, so every rank runs its collectives in the same sequence
(``run_traced_on_device``). An ordered ``io_callback``, which converts every
input and output, costs more a call (docs/performance.md); it serves where JAX
compiles for a GPU and the collective has no device path. Outputs of a
traced collective must have static shapes: collectives whose output shape
depends on other ranks (allgather, alltoall, ...) raise a clear error there.

On a GPU (JAX's default backend is a GPU and cupy imports), an allreduce
inside ``jax.jit`` is instead a ``jax.experimental.buffer_callback``: the
callback receives the device buffers and XLA's execution stream, so the
values go to cupy by DLPack, are fused and reduced by NCCL on that stream,
and are written into the output buffers, without a host copy (see
``run_traced_on_device`` for the ordering). JAX's own collectives are not
used: they need every process's devices in one JAX mesh
(``jax.distributed``), which Keras's per-process jitted step does not have.
Eager JAX arrays on a GPU go to cupy and back by DLPack, whose stream
argument orders them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from keras_dist import _compat, _config
from keras_dist._runtime import context
from keras_dist.tensor import gpu
from keras_dist.tensor.collective import Collective
from keras_dist.tensor.counters import COUNTERS


def is_traced(value) -> bool:
    return isinstance(value, jax.core.Tracer)


def to_numpy(array) -> np.ndarray:
    if is_traced(array):
        raise TypeError(
            "This keras_dist collective cannot run on a traced JAX array (inside jax.jit "
            "or a Keras train step on the JAX backend); call it outside the traced "
            "function. Received: a tracer of shape "
            f"{tuple(array.shape)} and dtype {array.dtype}")
    if _on_gpu(array):
        COUNTERS["device_to_host"] += 1
    return np.asarray(array)


def like(template, array: np.ndarray):
    return jnp.asarray(array)


def run_traced(values: Sequence, collective: Collective) -> list:
    """``collective.numpy_fn`` on traced values as one host callback.

    Its ``device_fn`` (device arrays in and out, same shapes and dtypes),
    where given, runs instead as a buffer callback on the GPU when
    ``traced_device_module`` finds one; on the CPU its ``xla_kernel``, where
    it builds the outputs, else its ``in_place``, where given (those two only
    where each output is shaped and typed as its input).
    """
    name, out_dtypes = collective.name, collective.out_dtypes
    same_shapes = collective.shapes is None and (out_dtypes is None
                                                 or len(out_dtypes) == len(values))
    if not same_shapes:
        raise NotImplementedError(
            f"keras_dist `{name}` on a traced JAX array needs a static output shape, which "
            "depends on the other ranks here: call it outside jax.jit (Keras's JAX train "
            "step is jitted). Received: a traced input of shape "
            f"{tuple(values[0].shape)}")
    values = [jnp.asarray(v) for v in values]
    if collective.device_fn is not None and out_dtypes is None:
        xp = traced_device_module(values)
        if xp is not None:
            return run_traced_on_device(values, collective.device_fn, xp)
    dtypes = list(out_dtypes) if out_dtypes is not None else [v.dtype for v in values]
    if jax.default_backend() == "cpu":
        like_inputs = collective.outputs_like_inputs
        native = collective.xla_kernel if like_inputs else None
        outputs = native(values) if native is not None else None
        if outputs is not None:
            return outputs
        # The buffers themselves, as numpy views (see the module's docstring).
        return run_traced_on_device(values, collective.numpy_fn, np, dtypes,
                                    collective.in_place if like_inputs else None)
    results = [jax.ShapeDtypeStruct(v.shape, d) for v, d in zip(values, dtypes)]

    def host(*arrays):
        outputs = collective.numpy_fn([np.asarray(a) for a in arrays])
        return tuple(np.asarray(o, dtype=r.dtype).reshape(r.shape)
                     for o, r in zip(outputs, results))

    from jax.experimental import io_callback

    return list(io_callback(host, tuple(results), *values, ordered=True))


def memory_notice(preallocate_setting: str | None) -> str | None:
    """Why NCCL and cupy may find no GPU memory left, or None.

    JAX takes 75% of every GPU it uses when its GPU backend starts, unless
    ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (or another allocator setting)
    was in the environment then; ``kd.init()`` sets it where the user has not,
    which serves when the backend has not started. ``preallocate_setting``
    is the variable as it was before ``kd.init()``.
    """
    if not _compat.jax_backends_started():
        return None
    if (preallocate_setting or "").strip().lower() in ("false", "0") or \
            os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR") == "platform" or \
            "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ:
        return None
    if not any(device.platform == "gpu" for device in jax.devices()):
        return None
    return ("keras_dist: JAX started its GPU backend before kd.init() and took 75% of the GPU's "
            "memory, so NCCL and keras_dist's fusion buffers may run out of it. Call kd.init() "
            "before JAX's first computation, or set XLA_PYTHON_CLIENT_PREALLOCATE=false before "
            "starting.")


# ---------------------------------------------------------------------------
# The device path.


def _on_gpu(array) -> bool:
    return all(device.platform == "gpu" for device in array.devices())


def device_module(arrays):
    """cupy when every (eager) array is on a GPU, of a dtype the device path
    carries, and cupy imports; None otherwise (the host path)."""
    if not all(_on_gpu(a) for a in arrays):
        return None
    return gpu.device_module(a.dtype for a in arrays)


def device_scope(arrays, xp):
    """cupy on the arrays' GPU; DLPack's stream argument orders the hand-overs."""
    if xp is np:
        return contextlib.nullcontext()
    return gpu.device_scope(xp, arrays[0].__dlpack_device__()[1])


def to_device_arrays(arrays, xp) -> list:
    return [xp.from_dlpack(a) for a in arrays]


def from_device_arrays(arrays, templates, xp) -> list:
    return [jnp.from_dlpack(a) for a in arrays]


def traced_device_module(values):
    """cupy when JAX compiles for a GPU, the values' dtypes are carried and cupy
    imports; None otherwise (the ordered host callback serves)."""
    if jax.default_backend() != "gpu":
        return None
    return gpu.device_module(v.dtype for v in values)


def run_traced_on_device(values: Sequence, device_fn: Callable, xp,
                         dtypes: Sequence | None = None,
                         in_place: Callable | None = None) -> list:
    """``device_fn`` inside ``jax.jit`` as one buffer callback on XLA's stream
    (outputs shaped as the values, of ``dtypes``, default the values').
    ``in_place`` (host buffers only: ``xp`` numpy, the values' dtypes), where
    given, runs instead on the outputs, each its input's buffer: XLA hands
    the callback outputs that hold their inputs' values (input/output aliases).

    Ordering: the callback runs when XLA reaches it on its execution stream
    (``ctx.stream``), after the ops that produced its inputs; cupy works on that
    stream (``gpu.device_scope``), NCCL on its own stream ordered after and
    before it by events, and the outputs are written on it, so XLA's next ops
    read them without a host wait; the collective's bounded wait is the host's
    only wait. A buffer callback, unlike ``io_callback(ordered=True)``, is not
    ordered by an effect token: each one traced in the same function takes an
    output of the previous one as an extra input, so every rank runs them in
    the order they were traced.

    ``xp`` is cupy on a GPU, numpy where JAX compiles for the CPU (the
    buffers are host memory; no stream).
    """
    from jax.experimental.buffer_callback import ExecutionStage, buffer_callback

    values = [jnp.asarray(v) for v in values]
    dtypes = list(dtypes) if dtypes is not None else [v.dtype for v in values]
    results = tuple(jax.ShapeDtypeStruct(v.shape, d) for v, d in zip(values, dtypes))
    count = len(values)

    def callback(ctx, outputs, *buffers) -> None:
        if ctx.stage != ExecutionStage.EXECUTE:
            return
        buffers = buffers[:count]
        stream = None if xp is np else ctx.stream
        device_id = buffers[0].__dlpack_device__()[1] if buffers else 0
        if in_place is not None:
            in_place([xp.from_dlpack(output) for output in outputs])
            return
        with gpu.device_scope(xp, device_id, stream):
            reduced = device_fn([xp.from_dlpack(b) for b in buffers])
            for output, result in zip(outputs, reduced):
                xp.from_dlpack(output)[...] = result.reshape(output.shape)

    aliases = {i: i for i in range(count)} if in_place is not None else None
    return _in_order(values, lambda previous: buffer_callback(
        callback, results, has_side_effect=True, input_output_aliases=aliases)(
            *values, *previous))


class TracedOrder:
    """The last keras_dist call traced into a JAX function, and one of its outputs.

    The process group holds one (``Group.traced_order``, made on first use:
    ``_in_order``), so it goes with the group at ``kd.shutdown``.
    """

    def __init__(self) -> None:
        self._trace = None
        self._output = None

    def chain(self, values: Sequence, call: Callable) -> list:
        """``call(previous)``'s outputs, ``previous`` an output of the last call
        traced into the values' function (or nothing): each takes the one before
        it as an extra input, so XLA runs them in the order they were traced."""
        trace = _compat.jax_trace(values[0])
        previous = [self._output] if trace is not None and self._trace is trace else []
        outputs = call(previous)
        if trace is not None and outputs:
            self._trace, self._output = trace, outputs[0]
        return list(outputs)


def _in_order(values: Sequence, call: Callable) -> list:
    """``call`` chained after the last call traced into the values' function
    (``TracedOrder``, the process group's)."""
    group = context.get()
    if group.traced_order is None:
        group.traced_order = TracedOrder()
    return group.traced_order.chain(values, call)


# ---------------------------------------------------------------------------
# keras_dist's XLA FFI handler (native/src/xla_handler.cc).

_TARGET = "keras_dist_allreduce"

#: The plans (``_native.ReductionPlan``) traced calls of the handler name, kept while
#: a compiled step may run them (until ``kd.shutdown``: ``forget_plans``).
_PLANS: list = []


def native_enabled() -> bool:
    """Whether a jitted step's allreduce on the CPU may take keras_dist's XLA FFI
    handler: ``jax.ffi`` registers it, and ``KERAS_DIST_JAX_OP`` is not ``0``
    (or ``false``/``off``/``no``: the buffer callback)."""
    return _config.switched_on("KERAS_DIST_JAX_OP") and _registered()


@functools.cache
def _registered() -> bool:
    """Registers the handler once; False (with a warning where XLA refuses it)
    where this JAX cannot call it: the buffer callback serves instead."""
    try:
        from jax import ffi
    except ImportError:
        return False
    from keras_dist import _native

    if _primitive() is None:
        return False
    try:
        ffi.register_ffi_target(_TARGET, ffi.pycapsule(_native.xla_allreduce_address()),
                                platform="cpu")
        # XLA asks the handler which FFI version it speaks when it compiles a
        # call: one call compiled (not run) tells whether this XLA takes it.
        jax.jit(lambda x: _primitive().bind(x, plan=0, count=1)).lower(
            jnp.zeros(1, jnp.float32)).compile()
    except Exception as error:  # noqa: BLE001 - any refusal means the fallback
        warnings.warn(f"keras_dist: JAX {jax.__version__} does not take keras_dist's XLA "
                      f"FFI handler ({type(error).__name__}: {error}); a jitted step's "
                      "allreduce runs as a buffer callback instead", RuntimeWarning,
                      stacklevel=2)
        return False
    return True


@functools.cache
def _primitive():
    """The JAX primitive of a call of the handler, or None where this JAX lacks
    what it needs. Not ``jax.ffi.ffi_call(..., has_side_effect=True)``: that
    gives the step a JAX effect, and an effectful jitted function dispatches
    through Python and tokens on every call. Here the HLO call has the side
    effect, so XLA never drops or merges it, JAX's dead-code pass keeps it
    all the same (``dce_rules``), and the step stays on JAX's fast path."""
    parts = _compat.jax_primitive_parts()
    try:
        from jax import ffi
    except ImportError:
        return None
    if parts is None or not hasattr(ffi, "ffi_lowering"):
        return None
    Primitive, mlir, pe = parts  # noqa: N806 - JAX's class
    primitive = Primitive(_TARGET)
    primitive.multiple_results = True

    def abstract(*values, plan: int, count: int):
        return [jax.core.ShapedArray(v.shape, v.dtype) for v in values[:count]]

    def lower(ctx, *values, plan: int, count: int):
        rule = ffi.ffi_lowering(_TARGET, has_side_effect=True,
                                operand_output_aliases={i: i for i in range(count)})
        return rule(ctx, *values, plan=np.int64(plan))

    def keep(used_outputs, equation):  # every input used, the call kept
        return [True] * len(equation.invars), equation

    primitive.def_abstract_eval(abstract)
    mlir.register_lowering(primitive, lower, platform="cpu")
    pe.dce_rules[primitive] = keep
    return primitive


def native_allreduce(values: Sequence, engine, reduction) -> list:
    """The allreduce of traced CPU values as one call of keras_dist's XLA FFI
    handler: each output is its input's buffer (input/output aliases),
    reduced in place by the shm engine with no Python on a good step; calls
    run in the order traced (``_in_order``). The handler runs the native
    plan TensorFlow's op runs (``reduction``, a ``native_plan.NativeReduction``)."""
    values = [jnp.asarray(v) for v in values]
    plan = reduction.native_plan(engine, [v.size * v.dtype.itemsize for v in values])
    _PLANS.append(plan)
    return _in_order(values, lambda previous: _primitive().bind(
        *values, *previous, plan=plan.id, count=len(values)))


def forget_plans() -> None:
    """Drops the handler's plans (at ``kd.shutdown``): a step compiled before
    then fails with a clear error if it runs again."""
    _PLANS.clear()
