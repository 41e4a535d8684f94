"""The Keras layer: the optimizer wrapper, callbacks, saving, learning-rate
helpers and XLA handling. It knows Keras and reaches the transports only
through the tensor layer's collectives."""

from __future__ import annotations

import warnings

_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Emits ``message`` as a ``UserWarning`` the first time ``key`` is seen."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


