"""The one exception hierarchy of keras_dist.

Every class here is picklable (its state lives in ``args``; PeerFailureError's
``peer_rank`` travels with it), so an error raised on one rank can be sent to
the others with ``broadcast_object``.
"""

from __future__ import annotations


class KerasDistError(RuntimeError):
    """Base class of every error keras_dist raises on its own account."""


class NotInitializedError(KerasDistError):
    """A keras_dist function was called before ``keras_dist.init()``."""


class CollectiveMismatchError(KerasDistError):
    """Ranks called collectives that do not match (shape, dtype, op, order...)."""


class PeerFailureError(KerasDistError):
    """A peer rank died or left the job while this rank waited on it.

    Args:
        message: what happened, naming the peer.
        peer_rank: the rank that failed first, when known: this error is a
            consequence of that rank's failure (kdrun names that rank, not this one).
    """

    def __init__(self, message: str = "", peer_rank: int | None = None) -> None:
        super().__init__(message)
        self.peer_rank = peer_rank

    def __reduce__(self):
        return type(self), (str(self), self.peer_rank)


class CollectiveTimeoutError(KerasDistError, TimeoutError):
    """A collective did not complete within ``KERAS_DIST_TIMEOUT_SECONDS``."""


class TransportError(KerasDistError):
    """A transport (MPI, shared memory, NCCL) failed or cannot serve a request."""


class RendezvousError(KerasDistError):
    """Processes that started themselves could not form their job (the
    rendezvous unreachable, a rank missing, sizes that disagree)."""


class StallWarning(UserWarning):
    """Some ranks have waited in a collective that others have not joined."""


class HostsUpdatedInterrupt(KerasDistError):
    """The launcher has hosts to add or remove: the job restarts at a new size.

    Raised on every rank at the same commit (``state.commit()`` or
    ``state.check_host_updates()``) of an elastic job; ``keras_dist.elastic.run``
    saves the current state and ends the rank so that kdrun can relaunch.

    Args:
        message: what changed.
        skip_sync: as Horovod's: nothing was lost, the state need not be restored.
    """

    def __init__(self, message: str = "", skip_sync: bool = True) -> None:
        super().__init__(message)
        self.skip_sync = skip_sync

    def __reduce__(self):
        return type(self), (str(self), self.skip_sync)
