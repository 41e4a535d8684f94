"""The native engine's errors and their translation into keras_dist's.

``keras_dist._native`` raises its own exception classes; every caller of the
engine (the shm transport, and the tensor layer where it calls the engine
directly: ``Transport.native_engine``) catches ``NATIVE_ERRORS`` and raises
``translate(error)`` instead, so users only ever see ``keras_dist.errors``.
"""

from __future__ import annotations

import re

from keras_dist import _native, errors

#: The classes of the errors the native engine raises.
NATIVE_ERRORS = (
    _native.CollectiveMismatchError,
    _native.PeerFailureError,
    _native.CollectiveTimeoutError,
    _native.TransportError,
)


# The peer a native PeerFailureError names after "<collective> on rank R: ": "rank P
# (pid ...) died ...", "rank P (local rank L) aborted: ...", "rank P has shut down
# keras_dist (left the group) ...", "cannot read the buffer of rank P ...". A bare
# "local rank P" is not a rank of the job: no peer then.
_PEER_RE = re.compile(r": (?:cannot read the buffer of )?rank (\d+) ")


def translate(exc: Exception) -> errors.KerasDistError:
    """The keras_dist error for a native engine error."""
    if isinstance(exc, _native.CollectiveMismatchError):
        return errors.CollectiveMismatchError(str(exc))
    if isinstance(exc, _native.PeerFailureError):
        found = _PEER_RE.search(str(exc))
        return errors.PeerFailureError(str(exc), peer_rank=int(found[1]) if found else None)
    if isinstance(exc, _native.CollectiveTimeoutError):
        return errors.CollectiveTimeoutError(str(exc))
    return errors.TransportError(str(exc))
