"""NCCL's communicator creation, bounded like every wait (no GPU needed: a stand-in
``nccl`` module whose communicator blocks until released)."""

import os
import socket
import subprocess
import sys
import threading

import pytest

from keras_dist._runtime.liveness import Waiter
from keras_dist.errors import CollectiveTimeoutError, PeerFailureError
from keras_dist.transports.nccl import create_communicator


class FakeDevice:
    def __init__(self) -> None:
        self.used_by = None

    def use(self) -> None:
        self.used_by = threading.get_ident()


class FakeNccl:
    """``NcclCommunicator`` blocks until ``release`` is set (as NCCL waits for every rank)."""

    class NcclError(RuntimeError):
        pass

    def __init__(self, fail: bool = False) -> None:
        self.release = threading.Event()
        self.fail = fail
        self.device_thread = None

    def NcclCommunicator(self, size, unique_id, rank):  # noqa: N802 - cupy's name
        self.release.wait(30)
        if self.fail:
            raise self.NcclError("ncclInvalidUsage")
        return ("communicator", size, unique_id, rank, threading.get_ident())


def _helpers():
    """The live threads that create a communicator."""
    return [thread for thread in threading.enumerate()
            if thread.name == "keras_dist-nccl-init" and thread.is_alive()]


def _waiter(timeout, peers=()):
    host = socket.gethostname()
    return Waiter([(0, host, os.getpid()), *[(r, host, pid) for r, pid in peers]], 0, 0,
                  timeout, "nccl")


def test_made_on_the_device_in_a_helper_thread_once_every_rank_has_called():
    nccl, device = FakeNccl(), FakeDevice()
    threading.Timer(0.3, nccl.release.set).start()  # the last rank arrives
    comm = create_communicator(nccl, device, 2, b"id", 0, _waiter(timeout=10))
    assert comm[:4] == ("communicator", 2, b"id", 0)
    assert comm[4] != threading.get_ident() and device.used_by == comm[4]


def test_a_rank_that_never_calls_times_out():
    nccl = FakeNccl()
    before = set(_helpers())
    try:
        with pytest.raises(CollectiveTimeoutError,
                           match=r"creating the NCCL communicator timed out on rank 0"):
            create_communicator(nccl, FakeDevice(), 2, b"id", 0, _waiter(timeout=0.5))
        # Raised by the bound, while NCCL still blocks (not once the stand-in gave up).
        assert set(_helpers()) - before, "the helper thread no longer waits in NCCL"
    finally:
        nccl.release.set()


def test_a_dead_local_peer_raises_at_once():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    nccl = FakeNccl()
    try:
        with pytest.raises(PeerFailureError, match=rf"rank 1 \(pid {dead.pid}\) died"):
            create_communicator(nccl, FakeDevice(), 2, b"id", 0,
                                _waiter(timeout=None, peers=[(1, dead.pid)]))
    finally:
        nccl.release.set()


def test_ncclerror_reaches_the_caller():
    nccl = FakeNccl(fail=True)
    nccl.release.set()
    with pytest.raises(FakeNccl.NcclError, match="ncclInvalidUsage"):
        create_communicator(nccl, FakeDevice(), 2, b"id", 0, _waiter(timeout=10))
