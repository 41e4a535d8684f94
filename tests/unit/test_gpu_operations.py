"""KERAS_DIST_GPU_OPERATIONS: which data plane GPU (cupy) values take.

The choice runs here on a stand-in group (no GPU on the CPU test machines);
the data paths themselves run on real GPUs in tests/gpu/test_nccl.py.
"""

import sys
import types

import numpy as np
import pytest

from keras_dist import _vocab, transports
from keras_dist._config import Config
from keras_dist.errors import TransportError
from keras_dist.transports.local import LocalTransport
from keras_dist.transports.staged import HostStagedTransport


class _Comm:
    """The control-plane calls gpu_transport makes; ``peers`` answers allgather."""

    def __init__(self, peers=()):
        self.peers = list(peers)
        self.gathered = []

    def allgather(self, value):
        self.gathered.append(value)
        return [value, *self.peers]


def _group(gpu_operations, peers=()):
    return types.SimpleNamespace(config=Config(gpu_operations=gpu_operations),
                                 comm=_Comm(peers), transport=LocalTransport(), local_rank=0,
                                 gpu_transport=None)


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
    assert group.comm.gathered == []  # an explicit choice needs no agreement


def test_nccl_asked_for_without_cupy_is_an_error_not_a_fallback(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` fails, as without it
    group = _group("nccl")
    with pytest.raises(TransportError, match="needs cupy with NCCL"):
        transports.gpu_transport(group)
    assert group.gpu_transport is None


def test_auto_without_cupy_reduces_on_the_host(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert not transports.nccl_available()
    group = _group("auto", peers=[False])
    assert isinstance(transports.gpu_transport(group), HostStagedTransport)
    assert group.comm.gathered == [False]


def test_auto_takes_nccl_only_when_every_rank_can(monkeypatch):
    import keras_dist.transports.nccl as nccl_module

    class StubNccl:
        def __init__(self, comm, local_rank, config):
            self.comm, self.local_rank, self.config = comm, local_rank, config

    monkeypatch.setattr(transports, "nccl_available", lambda: True)
    monkeypatch.setattr(nccl_module, "NcclTransport", StubNccl)
    one_rank_cannot = _group("auto", peers=[True, False])
    assert isinstance(transports.gpu_transport(one_rank_cannot), HostStagedTransport)
    every_rank_can = _group("auto", peers=[True, True])
    chosen = transports.gpu_transport(every_rank_can)
    assert isinstance(chosen, StubNccl) and chosen.comm is every_rank_can.comm
    assert chosen.config is every_rank_can.config  # its waits take the group's timeout


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
