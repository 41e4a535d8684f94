"""Bounded waits: dead peers, zombies, stall warnings and timeouts (no MPI needed)."""

import re
import socket
import subprocess
import sys
import time

import pytest

from keras_dist._runtime import liveness
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


def test_a_dead_peer_is_named():
    child = _sleeper()
    waiter = Waiter([(0, HOST, 1), (1, HOST, child.pid)], rank=0, stall_seconds=0,
                    timeout_seconds=None, transport="test")
    child.kill()
    with pytest.raises(PeerFailureError, match=rf"rank 1 \(pid {child.pid}\) died.*allreduce"):
        waiter.wait(lambda: False, "allreduce")
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
    with pytest.raises(CollectiveTimeoutError, match="KERAS_DIST_TIMEOUT_SECONDS=0.2") as got:
        waiter.wait(lambda: False, "allgather")
    waited = float(re.search(r"after ([0-9.]+) s", str(got.value))[1])
    assert waited >= 0.2, str(got.value)


def test_wait_timings_are_the_native_engines():
    """One set of timings: Python's waits read the native engine's table."""
    from keras_dist import _native

    assert liveness.WAIT_TIMINGS is _native.WAIT_TIMINGS


def test_wait_timings_are_ordered():
    timings = liveness.WAIT_TIMINGS
    for spin in ("spin_seconds", "python_spin_seconds"):
        assert 0 < timings[spin] <= timings["yield_seconds"] < timings["liveness_seconds"]
    assert 0 < timings["poll_sleep_seconds"] < timings["liveness_seconds"]
    assert 0 < timings["futex_wait_seconds"] < timings["liveness_seconds"]


def test_a_wait_that_completes_while_sleeping_between_polls_returns():
    """Past the spin and yield phases, the waiter still sees completion."""
    finish_at = time.monotonic() + 3 * liveness.WAIT_TIMINGS["liveness_seconds"]
    polls = []

    def test():
        polls.append(1)
        return time.monotonic() >= finish_at

    Waiter([(0, HOST, 1)], rank=0, stall_seconds=0, timeout_seconds=None,
           transport="test").wait(test, "barrier")
    assert time.monotonic() >= finish_at and len(polls) > 1
