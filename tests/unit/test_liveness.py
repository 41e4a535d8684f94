"""Bounded waits: dead peers, zombies, stall warnings and timeouts (no MPI needed)."""

import socket
import subprocess
import sys
import time

import pytest

from keras_dist._runtime.liveness import Waiter, process_alive
from keras_dist.errors import CollectiveTimeoutError, PeerFailureError, StallWarning

HOST = socket.gethostname()


def _sleeper():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_process_alive_sees_running_dead_and_zombie_processes():
    child = _sleeper()
    try:
        assert process_alive(child.pid)
        child.kill()
        deadline = time.monotonic() + 10
        while process_alive(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)  # not reaped yet: a zombie must count as dead
        assert not process_alive(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not process_alive(child.pid)


def test_a_dead_peer_is_named_within_a_second():
    child = _sleeper()
    waiter = Waiter([(0, HOST, 1), (1, HOST, child.pid)], rank=0, stall_seconds=0,
                    timeout_seconds=None, transport="test")
    child.kill()
    started = time.monotonic()
    with pytest.raises(PeerFailureError, match=rf"rank 1 \(pid {child.pid}\) died.*allreduce"):
        waiter.wait(lambda: False, "allreduce")
    assert time.monotonic() - started < 1.0
    child.wait()


def test_peers_on_other_machines_are_not_probed_by_pid():
    waiter = Waiter([(0, HOST, 1), (1, "elsewhere", 999999999)], rank=0, stall_seconds=0,
                    timeout_seconds=0.3, transport="test")
    with pytest.raises(CollectiveTimeoutError):
        waiter.wait(lambda: False, "barrier")


def test_stall_warns_once_naming_missing_ranks_then_completes():
    finish_at = time.monotonic() + 0.6
    waiter = Waiter([(0, HOST, 1)], rank=0, stall_seconds=0.2, timeout_seconds=None,
                    transport="test", arrivals=lambda: [2, 3])
    with pytest.warns(StallWarning, match=r"waited .* in broadcast.*not joined: \[2, 3\]") as got:
        waiter.wait(lambda: time.monotonic() >= finish_at, "broadcast")
    assert len([w for w in got if issubclass(w.category, StallWarning)]) == 1


def test_timeout_raises_naming_the_setting():
    waiter = Waiter([(0, HOST, 1)], rank=0, stall_seconds=0, timeout_seconds=0.2,
                    transport="test", arrivals=lambda: [1])
    started = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="KERAS_DIST_TIMEOUT_SECONDS=0.2"):
        waiter.wait(lambda: False, "allgather")
    assert 0.2 <= time.monotonic() - started < 2.0
