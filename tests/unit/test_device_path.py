"""The device path (GPU tensors to cupy by DLPack, fused, reduced, back) on the CPU.

There is no GPU here, so numpy stands in for cupy: CPU tensors of torch,
TensorFlow and JAX go through the same DLPack hand-overs, the same fusion
(``tensor.gpu``) and the same graph ops (a ``tf.py_function``, a JAX buffer
callback) that GPU tensors take; only the choice of cupy (``device_module``)
and cupy's streams are left to tests/gpu/. A stand-in transport plays the
other ranks, and results are checked against numpy float64.
"""

import collections
import types

import numpy as np
import pytest

import keras_dist as kd
from keras_dist import _vocab
from keras_dist._config import Config
from keras_dist.tensor import conversions, device_path, gpu
from keras_dist.tensor.compression import Compression

torch = pytest.importorskip("torch", reason="needs torch (the test extra installs it)")
jax = pytest.importorskip("jax", reason="needs jax (the test extra installs it)")
tf = pytest.importorskip("tensorflow", reason="needs tensorflow (the test extra installs it)")
jnp = jax.numpy

from keras_dist.tensor import jax_glue, torch_glue  # noqa: E402
from keras_dist.tensor.tf import glue as tf_glue  # noqa: E402

pytestmark = pytest.mark.usefixtures("initialised")


# ---------------------------------------------------------------------------
# DLPack hand-overs, numpy standing in for cupy.


def test_torch_dlpack_round_trip_shares_memory_both_ways():
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    (array,) = torch_glue.to_device_arrays([tensor], np)
    assert array.ctypes.data == tensor.data_ptr() and array.shape == (2, 3)
    (back,) = torch_glue.from_device_arrays([array], [tensor], np)
    assert back.data_ptr() == tensor.data_ptr() and torch.equal(back, tensor)
    grad_tensor = torch.ones(3, requires_grad=True)  # detached on the way, not refused
    (grad_array,) = torch_glue.to_device_arrays([grad_tensor], np)
    assert grad_array.ctypes.data == grad_tensor.data_ptr()


def test_tensorflow_dlpack_round_trip_keeps_values_and_shares_the_result():
    tensor = tf.constant(np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5)
    (array,) = tf_glue.to_device_arrays([tensor], np)
    np.testing.assert_array_equal(array, tensor.numpy())
    assert not array.flags.writeable  # TensorFlow's memory: read, never written
    result = np.arange(4, dtype=np.float32)
    (back,) = tf_glue.from_device_arrays([result], [tensor], np)
    result[0] = 100.0  # the tensor is the array's memory, not a copy
    assert back.numpy()[0] == 100.0 and back.dtype == tf.float32


def test_jax_dlpack_round_trip_keeps_values_and_shares_the_input():
    array = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    (view,) = jax_glue.to_device_arrays([array], np)
    assert view.ctypes.data == array.unsafe_buffer_pointer()
    (back,) = jax_glue.from_device_arrays([view * 2], [array], np)
    assert isinstance(back, jax.Array)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(array) * 2)


def test_only_gpu_values_of_carried_dtypes_choose_cupy():
    assert gpu.carries([np.float32, np.float16, np.int64])
    # bfloat16 only with an array module that has it (cupy 14; not numpy here).
    assert not gpu.carries([np.float32, _vocab.bfloat16_dtype()])
    assert not gpu.carries([np.int8])  # NCCL has no int8 reduction here
    # CPU tensors keep the host path.
    assert torch_glue.device_module([torch.ones(2)]) is None
    assert jax_glue.device_module([jnp.ones(2)]) is None
    assert tf_glue.device_module([tf.ones(2)]) is None
    assert device_path.device_path([torch.ones(2)]) is None
    assert device_path.device_path([torch.ones(2), jnp.ones(2)]) is None  # mixed frameworks


# ---------------------------------------------------------------------------
# Fusion and reduction on device arrays, other ranks played by a transport.


class _PeersTransport:
    """The GPU transport of rank 0 of ``1 + len(peers)`` ranks: each call adds
    the peers' next fused buffer. ``complete`` calls are counted."""

    name = "fake-nccl"
    stages_through_host = False

    def __init__(self, peer_buffers):
        self.peer_buffers = list(peer_buffers)
        self.calls, self.completed = [], []

    def allreduce(self, buf, op, name=None):
        assert op == _vocab.SUM and buf.ndim == 1
        self.calls.append((buf.dtype, buf.size, name))
        buf += self.peer_buffers.pop(0)

    def complete(self, what):
        self.completed.append(what)


def _fake_group(transport, size, threshold):
    return types.SimpleNamespace(size=size, gpu_transport=transport,
                                 config=Config(fusion_threshold_bytes=threshold))


@pytest.mark.parametrize("framework", ["torch", "jax", "tensorflow"])
def test_grouped_allreduce_on_device_matches_numpy_float64(framework):
    rng = np.random.default_rng(12)
    shapes = [(3, 4), (5,), (2, 2, 2)]
    ranks = 3
    mine = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    peers = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(ranks - 1)]
    # threshold: the first two arrays (48 + 20 bytes) fuse, the third goes alone.
    buckets = [[0, 1], [2]]
    peer_buffers = []  # each peer's fused buffer, laid out as every rank lays it out
    for bucket in buckets:
        offsets, total = gpu._layout([mine[i] for i in bucket])
        summed = np.zeros(total, np.float32)
        for peer in peers:
            for offset, i in zip(offsets, bucket):
                summed[offset : offset + mine[i].size] += peer[i].ravel() * np.float32(0.5)
        peer_buffers.append(summed)
    transport = _PeersTransport(peer_buffers)
    group = _fake_group(transport, ranks, threshold=70)
    counters = collections.Counter()
    make = {"torch": torch.from_numpy, "jax": jnp.asarray, "tensorflow": tf.constant}[framework]
    values = [make(m.copy()) for m in mine]
    glue = {"torch": torch_glue, "jax": jax_glue, "tensorflow": tf_glue}[framework]

    results = device_path.run_on_device(
        values, lambda arrays: gpu.grouped_allreduce(
            arrays, kd.Average, 0.5, 2.0, Compression.none, counters, "grads", group),
        glue, np)

    expected = [(m.astype(np.float64) + sum(p[i].astype(np.float64) for p in peers))
                * 0.5 * 2.0 / ranks for i, m in enumerate(mine)]
    for result, want, value in zip(results, expected, values):
        assert type(result) is type(value) or isinstance(result, type(value))
        (view,) = glue.to_device_arrays([result], np)
        assert view.ctypes.data % gpu.ALIGN_BYTES == 0  # frameworks need it aligned
        np.testing.assert_allclose(np.asarray(result), want, rtol=1e-6)
    # Fused by the threshold; the second member starts 256 bytes in (aligned).
    assert [c[1] for c in transport.calls] == [64 + 5, 8]
    assert transport.completed == ["grads average of 3 tensors"]  # one wait per call
    assert counters["allreduce"] == counters["gpu_allreduce"] == 2
    assert counters["device_to_host"] == 0
    for value, original in zip(values, mine):  # inputs untouched
        np.testing.assert_array_equal(np.asarray(value), original)


def test_a_device_allreduce_is_one_span_on_the_timeline(tmp_path, capsys):
    import json

    rng = np.random.default_rng(4)
    mine = [rng.standard_normal(s).astype(np.float32) for s in [(3, 4), (5,)]]
    peer = [rng.standard_normal(s).astype(np.float32) for s in [(3, 4), (5,)]]
    offsets, total = gpu._layout(mine)
    fused = np.zeros(total, np.float32)
    for offset, array in zip(offsets, peer):
        fused[offset : offset + array.size] = array.ravel()
    transport = _PeersTransport([fused])
    transport.wait_seconds = lambda: None  # as a GPU transport: whole calls
    path = tmp_path / "t.json"
    kd.start_timeline(str(path))
    try:
        results = gpu.grouped_allreduce([m.copy() for m in mine], kd.Sum, 1.0, 1.0,
                                        Compression.none, collections.Counter(), "grads",
                                        _fake_group(transport, 2, threshold=1 << 20),
                                        ["dense/kernel", "dense/bias"])
    finally:
        kd.stop_timeline()
    for result, a, b in zip(results, mine, peer):
        np.testing.assert_allclose(result, a.astype(np.float64) + b, rtol=1e-6)
    assert "1 collectives" in capsys.readouterr().err
    spans = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["allreduce"]  # not split: no wait counter
    assert spans[0]["args"] == {"bytes": 68, "name": "grads",
                                "tensors": ["dense/kernel", "dense/bias"]}


# ---------------------------------------------------------------------------
# The public collectives take the device path (size 1: scaling only).


def _numpy_device(monkeypatch, glue):
    calls = []

    def device_module(values):
        calls.append(len(values))
        return np

    monkeypatch.setattr(glue, "device_module", device_module)
    return calls


def test_torch_tensors_take_the_device_path_through_the_public_call(monkeypatch):
    calls = _numpy_device(monkeypatch, torch_glue)
    a, b = torch.arange(4, dtype=torch.float32), torch.ones(2, 2, dtype=torch.float64)
    scaled, same = kd.grouped_allreduce([a, b], op=kd.Sum, prescale_factor=3.0)
    assert calls == [2]
    assert isinstance(scaled, torch.Tensor) and torch.equal(scaled, a * 3)
    assert scaled.dtype == torch.float32 and same.dtype == torch.float64
    plain = kd.grouped_allreduce([a], op=kd.Sum)[0]
    assert plain is a  # size 1, nothing to do: the tensor itself, no conversion


def test_adasum_and_process_sets_keep_the_host_path(monkeypatch):
    calls = _numpy_device(monkeypatch, torch_glue)
    kd.allreduce(torch.ones(4), op=kd.Sum, process_set=kd.global_process_set)
    assert calls == [1]  # the global set is the job's group
    assert device_path.device_path([torch.ones(2)]) is not None
    from keras_dist.tensor import ops

    assert ops._device_allreduce(kd.Adasum, 1.0, 1.0, None, kd._get()) is None


def test_jax_inside_jit_takes_ordered_buffer_callbacks(monkeypatch):
    monkeypatch.setattr(jax_glue, "traced_device_module", lambda values: np)

    def step(x, y):
        first = kd.grouped_allreduce([x * 2.0], op=kd.Sum, prescale_factor=0.5)[0]
        second = kd.grouped_allreduce([y], op=kd.Sum, postscale_factor=4.0)[0]
        return first, second

    x, y = jnp.arange(4.0, dtype=jnp.float32), jnp.ones(3, jnp.float32)
    jaxpr = jax.make_jaxpr(step)(x, y).jaxpr
    callbacks = [e for e in jaxpr.eqns if e.primitive.name == "buffer_callback"]
    assert len(callbacks) == 2 and not any("io_callback" in e.primitive.name
                                           for e in jaxpr.eqns)
    # The second takes the first's output: XLA runs them in the traced order.
    assert callbacks[0].outvars[0] in callbacks[1].invars
    first, second = jax.jit(step)(x, y)
    np.testing.assert_array_equal(np.asarray(first), np.arange(4.0))
    np.testing.assert_array_equal(np.asarray(second), np.full(3, 4.0))


@pytest.mark.parametrize("native", ["1", "0"])
def test_jax_inside_jit_on_the_cpu_takes_ordered_buffer_callbacks_on_host_buffers(
        monkeypatch, native):
    # The allreduce runs in place on its input's buffer (a fresh one here, and
    # `x` itself, which the caller keeps), the broadcast through numpy_fn. In
    # a group of one rank the unscaled allreduce, which keras_dist's XLA
    # handler serves, adds no call at all (KERAS_DIST_JAX_OP=0: a callback).
    monkeypatch.setenv("KERAS_DIST_JAX_OP", native)

    def step(x, y):
        return (kd.grouped_allreduce([x * 3.0], op=kd.Sum)[0],
                kd.grouped_allreduce([x], op=kd.Sum, postscale_factor=2.0)[0],
                kd.broadcast(y, 0))

    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((5, 2)).astype(np.float32))
    kept = np.array(x)
    y = jnp.asarray(rng.integers(0, 9, 7).astype(np.int32))
    jaxpr = jax.make_jaxpr(step)(x, y).jaxpr
    names = [e.primitive.name for e in jaxpr.eqns]
    assert "io_callback" not in names, names
    assert "keras_dist_allreduce" not in names, names
    callbacks = [e for e in jaxpr.eqns if e.primitive.name == "buffer_callback"]
    assert len(callbacks) == (2 if native == "1" else 3)
    for before, after in zip(callbacks, callbacks[1:]):
        assert before.outvars[0] in after.invars
    for _ in range(2):
        summed, scaled, broadcast = jax.jit(step)(x, y)
        np.testing.assert_array_equal(np.asarray(summed), kept * 3.0)
        np.testing.assert_array_equal(np.asarray(scaled), kept * 2.0)
        np.testing.assert_array_equal(np.asarray(x), kept)
        assert broadcast.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(broadcast), np.asarray(y))


def test_jax_handler_refused_by_xla_leaves_the_buffer_callback(monkeypatch):
    # Where XLA will not take keras_dist's FFI handler (another FFI version),
    # registration warns and says no: a jitted step keeps the buffer callback.
    from jax import ffi

    assert jax_glue._registered()  # this JAX takes it

    def refuse(*args, **kwargs):
        raise RuntimeError("FFI API version 1 expected")

    monkeypatch.setattr(ffi, "register_ffi_target", refuse)
    with pytest.warns(RuntimeWarning, match="FFI API version 1 expected.*buffer callback"):
        assert jax_glue._registered.__wrapped__() is False


def _op_types(function, *args):
    graph = function.get_concrete_function(*args).graph
    return {op.type for op in graph.get_operations()}


def test_tf_function_on_a_gpu_machine_builds_a_py_function_that_hands_over_by_dlpack(
        monkeypatch):
    monkeypatch.setattr(conversions, "_tf_device_path_available", lambda: True)
    calls = _numpy_device(monkeypatch, tf_glue)
    syncs = []
    monkeypatch.setattr(tf_glue, "synchronize", lambda xp, device_id: syncs.append(device_id))

    @tf.function
    def step(x, y):
        return kd.grouped_allreduce([x, y], op=kd.Sum, prescale_factor=2.0)

    x, y = tf.constant([1.0, -2.0]), tf.constant([[3, 4]], dtype=tf.int64)
    assert "EagerPyFunc" in _op_types(step, x, y)
    doubled, ints = step(x, y)
    np.testing.assert_array_equal(doubled.numpy(), [2.0, -4.0])
    np.testing.assert_array_equal(ints.numpy(), [[6, 8]])
    assert calls and calls[-1] == 2 and syncs == [0]  # both tensors, one sync for the call

    variable = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:  # the op stays differentiable
        (reduced,) = tf.function(lambda: kd.grouped_allreduce(
            [variable * 3.0], op=kd.Sum, prescale_factor=2.0))()
        loss = tf.reduce_sum(reduced)
    np.testing.assert_array_equal(tape.gradient(loss, variable).numpy(), [6.0, 6.0])


def test_tf_function_without_a_gpu_keeps_the_numpy_function():
    step = tf.function(lambda x: kd.grouped_allreduce([x], op=kd.Sum, prescale_factor=2.0))
    types_ = _op_types(step, tf.constant([1.0]))
    assert "PyFunc" in types_ and "EagerPyFunc" not in types_
