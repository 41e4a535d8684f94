"""Device work on a side stream, ordered against the caller's stream, with bounded waits.

The NCCL transport queues each collective here. The interface is small on
purpose, so that the ordering and the watchdog are tested on the CPU with
fakes (tests/unit/test_device_queue.py):

- a stream has ``record(event=None) -> event``, ``wait_event(event)`` and
  ``ptr``; ``new_event``, where given, makes the events it records (cupy's
  ``Event(disable_timing=True)``: an event with timing costs more to
  record, and nothing here reads its time);
- an event has ``done`` (True once the work recorded before it has finished);
- the communicator has ``check_async_error()`` (raises the library's error
  for a failure found while the work ran) and ``abort()``.

cupy's ``Stream``/``Event`` and ``cupy.cuda.nccl.NcclCommunicator`` have
exactly these.

Ordering: ``launch`` makes the side stream wait for everything already queued
on the caller's current stream (an event, no host wait), queues the call on
the side stream, and makes the caller's stream wait for it (an event again):
work the caller queues afterwards sees the result, and the host does not
block. ``complete`` is the one host wait, once per call of the tensor layer
(not per tensor, not per bucket): it polls the event of the last launch
through a ``liveness.Waiter`` (a dead peer on this machine raises
``PeerFailureError``; past ``KERAS_DIST_TIMEOUT_SECONDS`` it raises
``CollectiveTimeoutError``; a long wait warns) and checks the communicator's
asynchronous error at each poll. On any of these the communicator is aborted
(``ncclCommAbort``: the kernels waiting for peers return, so the streams
drain) before the error is raised, and every later call raises
``TransportError`` naming the first failure. ``interrupted``, where given,
is asked at each launch and each poll for a reason to stop (a peer that
cannot take part any more, such as one that called ``join``): the queue
then aborts and raises ``TransportError`` with it.

cupy before 13.4 has no name for NCCL's status 6 (``ncclRemoteError``), so
constructing its ``NcclError`` raises ``KeyError(6)`` instead: a
``KeyError`` from the library counts as its error, the key as the status.
"""

from __future__ import annotations

from collections.abc import Callable

from keras_dist.errors import CollectiveTimeoutError, PeerFailureError, TransportError

#: ncclResult_t of a failure on a peer's side (ncclRemoteError, NCCL >= 2.12):
#: "a call failed possibly due to a network error or a remote process exiting
#: prematurely".
NCCL_REMOTE_ERROR = 6


class DeviceQueue:
    """Queues device calls after the caller's stream; waits for them, boundedly.

    Args:
        side_stream: the stream the calls run on (the transport's own).
        current_stream: returns the caller's current stream.
        comm: the communicator (``check_async_error``, ``abort``).
        waiter: a ``keras_dist._runtime.liveness.Waiter`` (peers, stall
            warning, timeout).
        library_error: the exception class ``comm`` raises (its ``status``
            attribute holds the library's result code).
        rank: this rank, for messages.
        transport: the transport's name, for messages.
        new_event: makes the events recorded on the streams (None: the
            streams' default).
        interrupted: returns a reason to stop waiting, or None (see the
            module docstring).
    """

    def __init__(self, side_stream, current_stream: Callable[[], object], comm, waiter,
                 library_error: type[BaseException], rank: int, transport: str = "nccl",
                 new_event: Callable[[], object] | None = None,
                 interrupted: Callable[[], str | None] | None = None) -> None:
        self.side_stream = side_stream
        self.current_stream = current_stream
        self.comm = comm
        self.waiter = waiter
        self.library_errors = (library_error, KeyError)
        self.new_event = new_event
        self.interrupted = interrupted
        self.rank = rank
        self.transport = transport
        self.failure: str | None = None
        self._pending = None  # the event of the last launch not yet waited for

    def launch(self, call: Callable[[int], object], what: str) -> None:
        """Runs ``call(side_stream.ptr)`` after the caller's queued work, before its next."""
        self._check_usable(what)
        self._check_interrupted(what)
        caller = self.current_stream()
        self.side_stream.wait_event(self._record(caller))
        try:
            call(self.side_stream.ptr)
        except self.library_errors as error:
            raise self._fail(error, what) from error
        done = self._record(self.side_stream)
        caller.wait_event(done)
        self._pending = done

    def _record(self, stream):
        return stream.record() if self.new_event is None else stream.record(self.new_event())

    def complete(self, what: str) -> None:
        """Returns once the last launch has finished on the device, or raises.

        Raises:
            PeerFailureError: a peer on this machine died, or NCCL reports a
                remote failure; the communicator was aborted.
            CollectiveTimeoutError: the wait passed the configured timeout;
                the communicator was aborted.
            TransportError: NCCL reported another asynchronous error (its
                status code in the message), or an earlier call failed.
        """
        self._check_usable(what)
        event, self._pending = self._pending, None
        if event is None:
            return

        def finished() -> bool:
            if event.done:
                return True
            try:
                self.comm.check_async_error()
            except self.library_errors as error:
                raise self._fail(error, what) from error
            self._check_interrupted(what)
            return False

        try:
            self.waiter.wait(finished, what)
        except (PeerFailureError, CollectiveTimeoutError) as error:
            self.abort(f"{type(error).__name__}: {error}")
            raise

    def _check_usable(self, what: str) -> None:
        if self.failure is not None:
            raise TransportError(
                f"{what} cannot run on rank {self.rank}: the {self.transport} communicator was "
                f"aborted after an earlier failure ({self.failure}). Restart the job (or let "
                "an elastic job restart it).")

    def _check_interrupted(self, what: str) -> None:
        reason = self.interrupted() if self.interrupted is not None else None
        if reason is not None:
            self.abort(reason)
            raise TransportError(f"{what} cannot run on rank {self.rank}: {reason}")

    def _fail(self, error: BaseException, what: str) -> BaseException:
        """Aborts the communicator; the keras_dist error for the library's ``error``."""
        status = error.args[0] if isinstance(error, KeyError) else getattr(error, "status", None)
        message = (f"{what} failed on rank {self.rank} (transport {self.transport}, "
                   f"status {status}): {error}; the communicator was aborted")
        self.abort(message)
        if status == NCCL_REMOTE_ERROR:
            return PeerFailureError(
                message + ". A peer rank exited or its network failed while this rank waited.")
        return TransportError(message)

    def abort(self, reason: str) -> None:
        """Aborts the communicator (once); later calls raise naming ``reason``."""
        if self.failure is None:
            self.failure = reason
            self.comm.abort()
