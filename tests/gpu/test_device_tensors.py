"""torch and JAX tensors on a real GPU at one rank: the device path, NCCL, fit.

Run with pytest on a GPU machine (once with KERAS_BACKEND=torch, once with
jax); tests/gpu/device_check.sh is the one-call check of the same paths.
Skipped, with the reason, without cupy, a GPU, or the framework's GPU.
One GPU is enough: NCCL runs a one-rank communicator here; NCCL will not put
two ranks on one GPU, so multi-rank NCCL runs in tests/gpu/test_nccl.py on
machines with two GPUs or more.
"""

import types

import numpy as np
import pytest

import keras_dist as kd
from keras_dist import _vocab, transports
from keras_dist._config import Config
from keras_dist.tensor import device_path, gpu, ops
from keras_dist.tensor.compression import Compression
from tests.gpu._gpu import cupy_with_a_gpu

cupy = cupy_with_a_gpu()


def _torch_cuda():
    torch = pytest.importorskip("torch", reason="needs torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA; torch.cuda.is_available() is False")
    return torch


def _jax_gpu():
    jax = pytest.importorskip("jax", reason="needs jax")
    if jax.default_backend() != "gpu":
        pytest.skip(f"needs jax with a GPU backend; its default backend is "
                    f"{jax.default_backend()!r} (pip install 'jax[cuda12]')")
    return jax


@pytest.fixture(scope="module", autouse=True)
def _initialised():
    kd.init()
    yield
    kd.shutdown()


@pytest.fixture(scope="module")
def nccl_one_rank():
    """The NCCL transport over a one-rank communicator, chosen as the job would."""
    from mpi4py import MPI

    from keras_dist.transports.local import LocalTransport

    group = types.SimpleNamespace(config=Config(gpu_operations="nccl", timeout_seconds=60.0),
                                  comm=MPI.COMM_SELF, rank=0, ranks=(0,), local_rank=0,
                                  transport=LocalTransport(), gpu_transport=None, size=1)
    transport = transports.gpu_transport(group, cupy.cuda.Device().id)
    yield transport
    transport.close()


def test_nccl_is_chosen_and_reduces_with_a_bounded_wait(nccl_one_rank):
    assert nccl_one_rank.name == "nccl"
    buf = cupy.arange(1000, dtype=cupy.float32)
    nccl_one_rank.allreduce(buf, _vocab.SUM, name="check")
    nccl_one_rank.complete("check")  # a real event, polled through the watchdog
    np.testing.assert_array_equal(cupy.asnumpy(buf), np.arange(1000, dtype=np.float32))
    nccl_one_rank.barrier()
    assert nccl_one_rank.queue.failure is None


def _through_nccl(transport, ranks=2):
    """``gpu.grouped_allreduce`` on the real NCCL transport, as a group of
    ``ranks`` ranks whose peers all hold zeros (NCCL's one rank): an Average
    is then the sum over this rank divided by ``ranks``."""
    group = types.SimpleNamespace(size=ranks, gpu_transport=transport,
                                  config=Config(fusion_threshold_bytes=4096))
    return lambda device_arrays: gpu.grouped_allreduce(
        device_arrays, kd.Average, 1.0, 1.0, Compression.none, ops.COUNTERS, "grads", group)


def test_torch_cuda_tensors_go_through_nccl_and_come_back_on_their_device(nccl_one_rank):
    torch = _torch_cuda()
    rng = np.random.default_rng(5)
    host = [rng.standard_normal(s).astype(np.float32) for s in [(300,), (17, 5), (2000,)]]
    values = [torch.from_numpy(h).cuda() for h in host]
    path = device_path.device_path(values)
    assert path is not None and path[1] is cupy  # the device path, not host memory
    results = device_path.run_on_device(values, _through_nccl(nccl_one_rank), *path)
    torch.cuda.current_stream().synchronize()
    for result, h in zip(results, host):
        assert isinstance(result, torch.Tensor) and result.is_cuda
        assert result.device == values[0].device
        np.testing.assert_allclose(result.cpu().numpy(), h.astype(np.float64) / 2, rtol=1e-6)


def test_torch_public_allreduce_returns_cuda_tensors():
    torch = _torch_cuda()
    t = torch.arange(8, dtype=torch.float32, device="cuda")
    (got,) = kd.grouped_allreduce([t], op=kd.Sum, prescale_factor=0.5)
    assert got.is_cuda and torch.equal(got, t * 0.5)
    assert kd.allreduce(t, op=kd.Sum).is_cuda


def test_jax_gpu_arrays_eager_and_inside_jit(nccl_one_rank):
    jax = _jax_gpu()
    jnp = jax.numpy
    x = jnp.arange(1000, dtype=jnp.float32)
    (got,) = kd.grouped_allreduce([x], op=kd.Sum, prescale_factor=0.5)
    assert all(d.platform == "gpu" for d in got.devices())
    np.testing.assert_array_equal(np.asarray(got), np.arange(1000) * 0.5)

    def step(v):
        return kd.grouped_allreduce([v * 2.0, v], op=kd.Sum, postscale_factor=0.25)

    names = [e.primitive.name for e in jax.make_jaxpr(step)(x).jaxpr.eqns]
    assert "buffer_callback" in names and "io_callback" not in names
    doubled, same = jax.jit(step)(x)
    np.testing.assert_array_equal(np.asarray(doubled), np.arange(1000) * 0.5)
    np.testing.assert_array_equal(np.asarray(same), np.arange(1000) * 0.25)

    # Eager JAX GPU arrays through the real NCCL transport.
    path = device_path.device_path([x])
    assert path is not None and path[1] is cupy
    (reduced,) = device_path.run_on_device([x], _through_nccl(nccl_one_rank), *path)
    np.testing.assert_allclose(np.asarray(reduced), np.arange(1000) / 2, rtol=1e-6)


def test_distributed_optimizer_fit_matches_one_process_reference(monkeypatch):
    """At one rank with the size-1 shortcut off, so every step's gradients do
    go through the GPU data plane (NCCL with one rank) and back."""
    import dataclasses

    from keras_dist._runtime import context

    group = context.get()
    monkeypatch.setattr(group, "config",
                        dataclasses.replace(group.config, size_one_shortcut=False))
    keras = pytest.importorskip("keras", reason="needs keras")
    backend = keras.backend.backend()
    if backend == "torch":
        _torch_cuda()
    elif backend == "jax":
        _jax_gpu()
    else:
        pytest.skip(f"runs on the torch and jax backends; KERAS_BACKEND={backend!r}")
    rng = np.random.default_rng(7)
    x = rng.standard_normal((256, 8)).astype(np.float32)
    y = (x @ rng.standard_normal((8, 1))).astype(np.float32)

    def train(optimizer):
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        return [np.asarray(keras.ops.convert_to_numpy(w)) for w in model.weights]

    reference = train(keras.optimizers.SGD(0.05))
    before = dict(ops.COUNTERS)
    distributed = train(kd.DistributedOptimizer(keras.optimizers.SGD(0.05)))
    steps = 2 * 256 // 32
    assert ops.COUNTERS["gpu_allreduce"] - before["gpu_allreduce"] >= steps
    assert ops.COUNTERS["device_to_host"] == before["device_to_host"]  # stayed on the GPU
    for got, want in zip(distributed, reference):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
