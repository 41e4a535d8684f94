"""The NCCL transport's ordering and watchdog (``transports.device_queue``), on fakes.

The streams, events and communicator here have the interface cupy's have;
they record what is done to them, so every branch runs on the CPU: the
ordering of a launch, a wait that completes, a timeout, an asynchronous error
(remote or other), a dead peer and a failing launch, each aborting the
communicator and raising as the CPU transports do.
"""

import socket
import subprocess

import pytest

from keras_dist._runtime.liveness import Waiter
from keras_dist.errors import CollectiveTimeoutError, PeerFailureError, TransportError
from keras_dist.transports.device_queue import NCCL_REMOTE_ERROR, DeviceQueue


class FakeNcclError(Exception):
    def __init__(self, status):
        super().__init__(f"NCCL error {status}")
        self.status = status


class FakeEvent:
    """Done once it has been polled ``polls_until_done`` times (None: never)."""

    def __init__(self, name, polls_until_done):
        self.name, self.polls, self.polls_until_done = name, 0, polls_until_done

    @property
    def done(self):
        self.polls += 1
        return self.polls_until_done is not None and self.polls >= self.polls_until_done


class FakeStream:
    def __init__(self, name, log, ptr, polls_until_done=1):
        self.name, self.log, self.ptr = name, log, ptr
        self.polls_until_done = polls_until_done
        self.events = []

    def record(self, event=None):
        if event is None:
            event = FakeEvent(f"{self.name}#{len(self.events)}", self.polls_until_done)
        self.events.append(event)
        self.log.append(("record", self.name, event.name))
        return event

    def wait_event(self, event):
        self.log.append(("wait", self.name, event.name))


class FakeComm:
    def __init__(self, log, error_status=None, error_after_checks=0):
        self.log, self.error_status, self.error_after_checks = log, error_status, error_after_checks
        self.checks = 0
        self.aborts = 0

    def check_async_error(self):
        self.checks += 1
        if self.error_status is not None and self.checks > self.error_after_checks:
            raise FakeNcclError(self.error_status)

    def abort(self):
        self.aborts += 1
        self.log.append(("abort",))


def _queue(polls_until_done=1, error_status=None, timeout=None, peers=(), error_after=0,
           **options):
    log = []
    side = FakeStream("side", log, ptr=1234, polls_until_done=polls_until_done)
    caller = FakeStream("caller", log, ptr=99)
    comm = FakeComm(log, error_status, error_after)
    waiter = Waiter(list(peers), 0, 0, timeout, "nccl")
    queue = DeviceQueue(side, lambda: caller, comm, waiter, FakeNcclError, rank=0, **options)
    return queue, log, comm, side


def test_launch_runs_after_the_callers_work_and_before_its_next_without_a_host_wait():
    queue, log, comm, side = _queue()
    launched = []
    queue.launch(lambda stream: launched.append(stream) or log.append(("call", stream)),
                 "allreduce")
    assert launched == [1234]  # on the side stream
    assert log == [
        ("record", "caller", "caller#0"),  # what the caller has queued so far...
        ("wait", "side", "caller#0"),  # ...comes first on the side stream
        ("call", 1234),
        ("record", "side", "side#0"),
        ("wait", "caller", "side#0"),  # the caller's next work waits for the call
    ]
    assert side.events[0].polls == 0 and comm.checks == 0  # nothing waited on the host


def test_complete_polls_the_last_launch_until_done_checking_async_errors():
    queue, log, comm, side = _queue(polls_until_done=4)
    queue.launch(lambda stream: None, "allreduce #1")
    queue.launch(lambda stream: None, "allreduce #2")
    queue.complete("allreduce of 2 tensors")
    assert side.events[0].polls == 0  # the earlier launch is covered by the last one
    assert side.events[1].polls == 4
    assert comm.checks == 3  # once per unfinished poll
    assert comm.aborts == 0
    queue.complete("nothing pending")  # returns at once
    assert side.events[1].polls == 4
    queue.launch(lambda stream: None, "allreduce #3")  # still usable


def test_timeout_aborts_the_communicator_and_raises_naming_the_call():
    queue, log, comm, _ = _queue(polls_until_done=None, timeout=0.0)
    queue.launch(lambda stream: None, "allreduce")
    with pytest.raises(CollectiveTimeoutError, match=r"allreduce of 3 tensors timed out on "
                                                     r"rank 0 .*transport nccl"):
        queue.complete("allreduce of 3 tensors")
    assert comm.aborts == 1 and log[-1] == ("abort",)
    with pytest.raises(TransportError, match=r"communicator was aborted after an earlier "
                                             r"failure \(CollectiveTimeoutError"):
        queue.launch(lambda stream: pytest.fail("launched on an aborted communicator"),
                     "allreduce")
    with pytest.raises(TransportError, match="aborted"):
        queue.complete("allreduce")
    assert comm.aborts == 1


def test_async_error_aborts_and_raises_with_the_status_code():
    queue, log, comm, _ = _queue(polls_until_done=None, error_status=3, error_after=2)
    queue.launch(lambda stream: None, "allreduce")
    with pytest.raises(TransportError, match=r"allreduce failed on rank 0 \(transport nccl, "
                                             r"status 3\): NCCL error 3; the communicator "
                                             r"was aborted") as caught:
        queue.complete("allreduce")
    assert not isinstance(caught.value, PeerFailureError)
    assert comm.checks == 3 and comm.aborts == 1
    with pytest.raises(TransportError, match="aborted after an earlier failure"):
        queue.launch(lambda stream: None, "allreduce")


def test_remote_async_error_is_a_peer_failure():
    queue, _, comm, _ = _queue(polls_until_done=None, error_status=NCCL_REMOTE_ERROR)
    queue.launch(lambda stream: None, "allreduce")
    with pytest.raises(PeerFailureError, match="A peer rank exited or its network failed"):
        queue.complete("allreduce")
    assert comm.aborts == 1


def test_dead_peer_on_this_machine_aborts_and_raises_naming_it():
    child = subprocess.Popen(["true"])
    child.wait()  # reaped: its pid is no longer a live process
    peers = [(0, socket.gethostname(), 1), (1, socket.gethostname(), child.pid)]
    queue, _, comm, _ = _queue(polls_until_done=None, peers=peers)
    queue.launch(lambda stream: None, "allreduce")
    with pytest.raises(PeerFailureError, match=rf"rank 1 \(pid {child.pid}\) died while "
                                               r"rank 0 waited in allreduce") as caught:
        queue.complete("allreduce")
    assert caught.value.peer_rank == 1
    assert comm.aborts == 1


def test_failing_launch_aborts_and_raises():
    queue, _, comm, side = _queue()

    def launch(stream):
        raise FakeNcclError(5)  # ncclInvalidUsage

    with pytest.raises(TransportError, match=r"broadcast failed on rank 0 \(transport nccl, "
                                             r"status 5\)"):
        queue.launch(launch, "broadcast")
    assert comm.aborts == 1 and side.events == []  # nothing recorded for a failed call


def test_events_come_from_the_factory_where_given():
    made = []

    def new_event():  # cupy: Event(disable_timing=True)
        made.append(FakeEvent(f"untimed#{len(made)}", 1))
        return made[-1]

    queue, log, _, _ = _queue(new_event=new_event)
    queue.launch(lambda stream: None, "allreduce")
    assert [entry[2] for entry in log if entry[0] == "record"] == ["untimed#0", "untimed#1"]
    queue.complete("allreduce")
    assert made[1].polls == 1


def test_a_status_old_cupy_cannot_name_raises_as_that_status():
    # cupy before 13.4 has no name for status 6: building its NcclError raises KeyError(6).
    queue, _, comm, _ = _queue(polls_until_done=None)

    def unnamed_remote_error():
        raise KeyError(NCCL_REMOTE_ERROR)

    comm.check_async_error = unnamed_remote_error
    queue.launch(lambda stream: None, "allreduce")
    with pytest.raises(PeerFailureError, match=r"status 6"):
        queue.complete("allreduce")
    assert comm.aborts == 1


def test_an_interruption_aborts_and_raises_its_reason_at_the_wait_and_the_next_launch():
    reasons = [None, None]
    queue, log, comm, _ = _queue(polls_until_done=None, interrupted=lambda: reasons[-1])
    queue.launch(lambda stream: None, "allreduce")
    reasons.append("rank 1 called join()")
    with pytest.raises(TransportError, match=r"allreduce cannot run on rank 0: rank 1 called "
                                             r"join\(\)"):
        queue.complete("allreduce")
    assert comm.aborts == 1
    with pytest.raises(TransportError, match="rank 1 called join"):
        queue.launch(lambda stream: pytest.fail("launched after the interruption"), "next")
    assert comm.aborts == 1
