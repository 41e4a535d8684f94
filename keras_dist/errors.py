"""The one exception hierarchy of keras_dist.

Every class here is picklable (its state lives in ``args``), so an error raised
on one rank can be sent to the others with ``broadcast_object``.
"""

from __future__ import annotations


class KerasDistError(RuntimeError):
    """Base class of every error keras_dist raises on its own account."""


class NotInitializedError(KerasDistError):
    """A keras_dist function was called before ``keras_dist.init()``."""


class CollectiveMismatchError(KerasDistError):
    """Ranks called collectives that do not match (shape, dtype, op, order...)."""


class PeerFailureError(KerasDistError):
    """A peer rank died or left the job while this rank waited on it."""


class CollectiveTimeoutError(KerasDistError, TimeoutError):
    """A collective did not complete within ``KERAS_DIST_TIMEOUT_SECONDS``."""


class TransportError(KerasDistError):
    """A transport (MPI, shared memory, NCCL) failed or cannot serve a request."""


class StallWarning(UserWarning):
    """Some ranks have waited in a collective that others have not joined."""
