"""KERAS_DIST_GPU_OPERATIONS: which data plane GPU (cupy) values take.

The choice runs here on a stand-in group (no GPU on the CPU test machines);
the data paths themselves run on real GPUs in tests/gpu/test_nccl.py.
"""

import socket
import sys
import types
import warnings

import numpy as np
import pytest

from keras_dist import _vocab, transports
from keras_dist._config import Config
from keras_dist.errors import TransportError
from keras_dist.tensor.compression import Compression
from keras_dist.transports.local import LocalTransport
from keras_dist.transports.staged import HostStagedTransport

HOST = socket.gethostname()


class _AgreeingTransport(LocalTransport):
    """The group's CPU transport; ``peers`` are the other ranks' GPU places
    ((host, GPU) or None: no NCCL) in the agreement ``gpu_transport`` makes."""

    def __init__(self, peers=()):
        super().__init__()
        self.peers = list(peers)
        self.agreements = []

    def allgather_records(self, send, recv, name=None):
        self.agreements.append(name)
        width = send.size
        recv[:width] = send
        for index, peer in enumerate(self.peers, start=1):
            recv[index * width : (index + 1) * width] = transports.place_record(peer)


def _group(gpu_operations, peers=()):
    return types.SimpleNamespace(config=Config(gpu_operations=gpu_operations), comm=object(),
                                 transport=_AgreeingTransport(peers), rank=0,
                                 size=1 + len(peers), ranks=tuple(range(1 + len(peers))),
                                 gpu_transport=None)


@pytest.fixture
def nccl_here(monkeypatch):
    """This rank has cupy with NCCL and GPU "0000:01:00.0" (and its device id:
    the NCCL transport is a stub recording its arguments)."""
    import keras_dist.transports.nccl as nccl_module

    class StubNccl:
        def __init__(self, comm, device_id, config, rank_names=None):
            self.comm, self.device_id, self.config = comm, device_id, config
            self.rank_names = rank_names

    monkeypatch.setattr(nccl_module, "unavailable_reason", lambda: None)
    monkeypatch.setattr(nccl_module, "gpu_identity", lambda device_id: f"0000:0{device_id}:00.0")
    monkeypatch.setattr(nccl_module, "NcclTransport", StubNccl)
    return StubNccl


@pytest.mark.parametrize("env, expected", [
    ({}, "auto"),
    ({"KERAS_DIST_GPU_OPERATIONS": "MPI"}, "mpi"),
    ({"HOROVOD_GPU_OPERATIONS": "nccl"}, "nccl"),
    ({"HOROVOD_GPU_OPERATIONS": "nccl", "KERAS_DIST_GPU_OPERATIONS": "mpi"}, "mpi"),
])
def test_setting_and_its_horovod_alias(monkeypatch, env, expected):
    for key in ("KERAS_DIST_GPU_OPERATIONS", "HOROVOD_GPU_OPERATIONS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert Config.from_env().gpu_operations == expected


def test_unknown_setting_says_what_is_accepted(monkeypatch):
    monkeypatch.setenv("KERAS_DIST_GPU_OPERATIONS", "gloo")
    with pytest.raises(ValueError, match=r"one of \('auto', 'nccl', 'mpi'\). "
                                         r"Received: KERAS_DIST_GPU_OPERATIONS='gloo'"):
        Config.from_env()


def test_mpi_stages_through_the_cpu_transport_and_is_kept():
    group = _group("mpi")
    chosen = transports.gpu_transport(group)
    assert isinstance(chosen, HostStagedTransport) and chosen.cpu is group.transport
    assert transports.gpu_transport(group) is chosen
    assert group.transport.agreements == []  # an explicit choice needs no agreement


def test_nccl_asked_for_without_cupy_is_an_error_not_a_fallback(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` fails, as without it
    group = _group("nccl", peers=[(HOST, "0000:02:00.0")])
    with pytest.raises(TransportError, match="needs cupy with NCCL"):
        transports.gpu_transport(group)
    assert group.gpu_transport is None
    assert len(group.transport.agreements) == 1  # the peers learn it in the agreement


def test_nccl_asked_for_raises_on_the_ranks_that_could_too(nccl_here):
    group = _group("nccl", peers=[(HOST, "0000:02:00.0"), None])
    with pytest.raises(TransportError, match=r"ranks \[2\] cannot use NCCL"):
        transports.gpu_transport(group)


def test_nccl_asked_for_with_ranks_sharing_a_gpu_says_which(nccl_here):
    group = _group("nccl", peers=[(HOST, "0000:02:00.0"), (HOST, "0000:01:00.0")])
    with pytest.raises(TransportError,
                       match=rf"ranks \[0, 2\] share GPU 0000:01:00.0 on {HOST}.*refuses"):
        transports.gpu_transport(group, device_id=1)


def test_auto_stages_through_the_host_when_ranks_share_a_gpu(nccl_here):
    group = _group("auto", peers=[(HOST, "0000:01:00.0")])
    with pytest.warns(RuntimeWarning, match=r"ranks \[0, 1\] share GPU.*staged through host"):
        chosen = transports.gpu_transport(group, device_id=1)
    assert isinstance(chosen, HostStagedTransport) and chosen.stages_through_host


def test_the_same_gpu_name_on_another_host_is_another_gpu(nccl_here):
    group = _group("auto", peers=[("another-host", "0000:01:00.0")])
    chosen = transports.gpu_transport(group, device_id=1)
    assert isinstance(chosen, nccl_here) and chosen.device_id == 1
    assert chosen.config is group.config  # its waits take the group's timeout
    assert chosen.rank_names == group.ranks


def test_auto_without_cupy_reduces_on_the_host(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert not transports.nccl_available()
    group = _group("auto", peers=[None])
    assert isinstance(transports.gpu_transport(group), HostStagedTransport)
    assert len(group.transport.agreements) == 1


def test_auto_takes_nccl_only_when_every_rank_can(nccl_here):
    one_rank_cannot = _group("auto", peers=[(HOST, "0000:02:00.0"), None])
    assert isinstance(transports.gpu_transport(one_rank_cannot), HostStagedTransport)
    every_rank_can = _group("auto", peers=[(HOST, "0000:02:00.0"), (HOST, "0000:03:00.0")])
    chosen = transports.gpu_transport(every_rank_can, device_id=1)
    assert isinstance(chosen, nccl_here) and chosen.comm is every_rank_can.comm


def test_agreement_records_round_trip():
    group = _group("auto", peers=[("h\u00e9te", "0000:0a:00.0"), None])
    places = transports._gather_gpu_places(group, ("here", "0000:01:00.0"))
    assert places == [("here", "0000:01:00.0"), ("h\u00e9te", "0000:0a:00.0"), None]


class _DeviceArray(np.ndarray):
    """Stands in for a cupy array: ``get`` copies to the host, ``set`` copies back."""

    def get(self):
        return np.array(self, copy=True)

    def set(self, host):
        assert host.shape == self.shape and host.dtype == self.dtype
        np.copyto(np.asarray(self), host)


class _SumOfTwoCpu:
    """A CPU transport whose peer holds the same values: a sum doubles them."""

    name = "shm"

    def __init__(self):
        self.calls = []

    def allreduce(self, buf, op, name=None, send=None):
        assert type(buf) is np.ndarray and send is None
        self.calls.append((op, name))
        buf *= 2


def test_host_staged_allreduce_reduces_a_host_copy_into_the_device_buffer():
    cpu = _SumOfTwoCpu()
    staged = HostStagedTransport(cpu)
    values = np.random.default_rng(3).standard_normal(11).astype(np.float32)
    device = values.copy().view(_DeviceArray)
    staged.allreduce(device, _vocab.SUM, name="grads")
    np.testing.assert_array_equal(np.asarray(device), values * 2)
    assert cpu.calls == [(_vocab.SUM, "grads")]
    assert staged.name == "host-staged shm"


# ---------------------------------------------------------------------------
# Whether GPU values can reach cupy at all (``gpu.usable_cupy``).


@pytest.fixture
def fresh_cupy_check(monkeypatch):
    from keras_dist.tensor import gpu

    gpu._cupy_or_reason.cache_clear()
    monkeypatch.setattr(gpu, "_NOTICES", set())
    yield gpu
    gpu._cupy_or_reason.cache_clear()


def _initialised_with(monkeypatch, gpu_operations):
    from keras_dist._runtime import context

    group = types.SimpleNamespace(config=Config(gpu_operations=gpu_operations))
    monkeypatch.setattr(context, "is_initialized", lambda: True)
    monkeypatch.setattr(context, "get", lambda: group)


def test_without_cupy_gpu_values_take_the_host_path_with_one_notice(monkeypatch,
                                                                    fresh_cupy_check):
    monkeypatch.setitem(sys.modules, "cupy", None)
    _initialised_with(monkeypatch, "auto")
    with pytest.warns(RuntimeWarning, match="through host memory: cupy does not import"):
        assert fresh_cupy_check.usable_cupy() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once is enough
        assert fresh_cupy_check.device_module([np.float32]) is None


def test_nccl_asked_for_and_no_cupy_is_an_error_for_gpu_values(monkeypatch, fresh_cupy_check):
    monkeypatch.setitem(sys.modules, "cupy", None)
    _initialised_with(monkeypatch, "nccl")
    with pytest.raises(TransportError, match=r"KERAS_DIST_GPU_OPERATIONS=nccl asks for NCCL, "
                                             r"but GPU values cannot reach it: cupy does not "
                                             r"import"):
        fresh_cupy_check.device_module([np.float32])


def test_a_cupy_that_cannot_use_cuda_is_named_not_crashed_on(monkeypatch, fresh_cupy_check):
    class CUDARuntimeError(RuntimeError):
        pass

    def no_driver():
        raise CUDARuntimeError("cudaErrorInsufficientDriver: CUDA driver version is "
                               "insufficient for CUDA runtime version")

    broken = types.ModuleType("cupy")
    broken.__version__ = "14.2.0"
    broken.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=no_driver))
    monkeypatch.setitem(sys.modules, "cupy", broken)
    _initialised_with(monkeypatch, "auto")
    with pytest.warns(RuntimeWarning, match=r"cupy 14.2.0 imports but cannot use CUDA "
                                            r"\(CUDARuntimeError: cudaErrorInsufficientDriver"):
        assert fresh_cupy_check.usable_cupy() is None


def test_framework_streams_are_wrapped_once_without_cupys_deprecation_warning():
    from keras_dist.tensor import gpu

    made = []

    class ExternalStream:
        def __init__(self, pointer, device_id):
            warnings.warn("ExternalStream is deprecated", DeprecationWarning, stacklevel=2)
            made.append((pointer, device_id))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Device(ExternalStream):
        def __init__(self, device_id):
            self.device_id = device_id

    fake = types.ModuleType("stand_in_cupy")
    fake.cuda = types.SimpleNamespace(ExternalStream=ExternalStream, Device=Device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            with gpu.device_scope(fake, 1, stream_pointer=0xBEEF):
                pass
    assert made == [(0xBEEF, 1)]


# ---------------------------------------------------------------------------
# The size-1 shortcut, and join with NCCL.


def test_the_size_one_shortcut_can_be_turned_off_for_checks(monkeypatch):
    from keras_dist.tensor import gpu

    monkeypatch.setenv("KERAS_DIST_SIZE_ONE_SHORTCUT", "0")
    assert Config.from_env().size_one_shortcut is False

    class OneRank:  # NCCL with one rank: what it returns is what it was given
        name, stages_through_host = "nccl", False

        def __init__(self):
            self.calls = 0

        def allreduce(self, buf, op, name=None):
            self.calls += 1

        def complete(self, what):
            pass

    values = [np.random.default_rng(5).standard_normal(7).astype(np.float32)]
    for shortcut, calls in ((True, 0), (False, 1)):
        transport = OneRank()
        group = types.SimpleNamespace(size=1, gpu_transport=transport,
                                      config=Config(size_one_shortcut=shortcut))
        counters = dict.fromkeys(("allreduce", "gpu_allreduce", "device_to_host"), 0)
        (result,) = gpu.grouped_allreduce(values, _vocab.Average, 2.0, 0.5, Compression.none,
                                          counters, group=group)
        np.testing.assert_allclose(result, values[0].astype(np.float64) * 2.0 * 0.5, rtol=1e-6)
        assert transport.calls == counters["gpu_allreduce"] == calls


def test_join_with_nccl_raises_on_the_joining_rank_after_telling_the_others(monkeypatch):
    from keras_dist._runtime import context
    from keras_dist.tensor import join

    class Refusing:
        def __init__(self):
            self.told = []

        def refuse_join(self, rank):
            self.told.append(rank)
            return "rank 1 called join(), and NCCL cannot reduce GPU values without every rank"

    class Cpu:
        def join(self):
            pytest.fail("the CPU join exchange must not start: the others would wait in NCCL")

    refusing = Refusing()
    group = types.SimpleNamespace(size=2, rank=1, ranks=(0, 1), gpu_transport=refusing,
                                  transport=Cpu())
    monkeypatch.setattr(context, "group_for", lambda process_set=None: group)
    with pytest.raises(TransportError, match=r"join\(\) cannot run on rank 1: rank 1 called "
                                             r"join\(\), and NCCL cannot"):
        join.join()
    assert refusing.told == [1]


def test_cpu_transports_and_host_staging_serve_join():
    staged = HostStagedTransport(LocalTransport())
    assert staged.refuse_join(0) is None and LocalTransport().refuse_join(0) is None


# ---------------------------------------------------------------------------
# GPU memory left to NCCL and the fusion buffers.


def test_init_sets_the_memory_settings_the_user_left_unset(monkeypatch):
    from keras_dist.tensor import gpu_memory

    monkeypatch.delenv("TF_FORCE_GPU_ALLOW_GROWTH", raising=False)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")  # the user's choice stays
    gpu_memory.leave_gpu_memory()
    import os

    assert os.environ["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"


def test_a_jax_that_started_on_a_gpu_with_preallocation_is_named(monkeypatch):
    jax = pytest.importorskip("jax")
    from keras_dist.tensor import jax_glue

    monkeypatch.setattr(jax._src.xla_bridge, "backends_are_initialized", lambda: True)
    monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(platform="gpu")])
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    assert "took 75% of the GPU" in jax_glue.memory_notice(None)
    assert jax_glue.memory_notice("false") is None
    monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(platform="cpu")])
    assert jax_glue.memory_notice(None) is None
