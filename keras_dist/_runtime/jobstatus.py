"""What a rank tells its supervisor (``keras_dist.launcher.supervisor``): facts, as they happen.

Under kdrun every rank runs as the child of a supervisor, which hands it one end
of a private socket, its descriptor in ``KERAS_DIST_SUPERVISOR_FD``. Each fact is
one JSON line:

- ``{"event": "started"}`` when ``init()`` succeeds;
- ``{"event": "finished"}`` when the rank shuts down cleanly;
- ``{"event": "error", "type", "message", "peer_rank", "mono", "wall"}`` for an
  unhandled exception: its class, message, the rank whose failure it is a
  consequence of (``PeerFailureError.peer_rank``, else None), and the
  CLOCK_MONOTONIC and wall times at which it was reported. The supervisor
  answers one byte once it has forwarded the record.

The supervisor adds what the rank cannot know about itself (how it ended) and
sends it all to kdrun. Writing never raises: a report that cannot be made
must not hide the user's own error. Every writer is a no-op without a
supervisor (no launcher, plain ``mpiexec``).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import socket
import struct
import time

SUPERVISOR_FD_ENV = "KERAS_DIST_SUPERVISOR_FD"
#: How long the rank waits for its supervisor to confirm it forwarded an error.
ACK_TIMEOUT_SECONDS = 5.0
#: Longest exception message sent (the traceback itself goes to stderr whole).
_MESSAGE_CHARS = 2000

_channel: socket.socket | None = None
_channel_fd: str | None = None


def _get_channel() -> socket.socket | None:
    """The socket to the supervisor, opened on first use (None without one)."""
    global _channel, _channel_fd
    fd = os.environ.get(SUPERVISOR_FD_ENV, "")
    if fd != _channel_fd:
        _channel_fd, _channel = fd, None
        if fd.isdigit():
            _channel = _open_channel(int(fd))
    return _channel


def _open_channel(fd: int) -> socket.socket | None:
    """The socket ``fd`` when its other end belongs to this process's parent.

    A process that inherited the variable but not the descriptor (a command
    the rank started itself) may have anything at that number: it is left alone.
    """
    try:
        channel = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        creds = channel.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                   struct.calcsize("3i"))
        if channel.family == socket.AF_UNIX and struct.unpack("3i", creds)[0] == os.getppid():
            channel.set_inheritable(False)
            # Closed last at exit (atexit runs in reverse order of registration:
            # after ``shutdown``, registered by ``init`` later, has reported).
            atexit.register(channel.close)
            return channel
    except OSError:
        pass
    channel.detach()
    return None


def _send(record: dict) -> socket.socket | None:
    channel = _get_channel()
    if channel is None:
        return None
    try:
        channel.sendall(json.dumps(record).encode() + b"\n")
    except OSError:
        return None
    return channel


def supervised() -> bool:
    """True when this process runs under kdrun's supervisor."""
    return _get_channel() is not None


def record_start(rank: int) -> None:
    """Reports that the rank is running (``init()`` done)."""
    _send({"event": "started", "rank": int(rank)})


def record_done(rank: int) -> None:
    """Reports that the rank shut down cleanly."""
    _send({"event": "finished", "rank": int(rank)})


def record_error(exc: BaseException) -> bool:
    """Reports an unhandled exception; returns once the supervisor has forwarded it.

    Returns:
        True when the supervisor confirmed it (within ``ACK_TIMEOUT_SECONDS``).
    """
    cls = type(exc)
    name = cls.__qualname__ if cls.__module__ == "builtins" else (
        f"{cls.__module__}.{cls.__qualname__}")
    peer = getattr(exc, "peer_rank", None)
    channel = _send({
        "event": "error", "type": name, "message": str(exc)[:_MESSAGE_CHARS],
        "peer_rank": peer if isinstance(peer, int) else None,
        "mono": time.monotonic(), "wall": time.time(),
    })
    if channel is None:
        return False
    deadline = time.monotonic() + ACK_TIMEOUT_SECONDS
    try:
        while True:
            ready, _, _ = select.select([channel], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return False
            data = channel.recv(4096)
            if not data:
                return False
            # Host-update notices (``H <n>`` lines) may come first; the answer is one "k".
            _notices.extend(data.replace(b"k", b"").split())
            if b"k" in data:
                return True
    except OSError:
        return False


def record_resize() -> None:
    """Reports that the rank ends for a graceful resize of an elastic job (its
    state is saved): kdrun relaunches the job instead of ending it."""
    _send({"event": "resize"})


def record_resumed(info: dict) -> None:
    """Reports that an elastic job is training again (``info``: commit, epoch,
    batch, seconds spent restoring...), with the times this rank saw it."""
    _send({"event": "resumed", "info": info, "mono": time.monotonic(), "wall": time.time()})


_notices: list[bytes] = []


def host_update_version() -> int:
    """The newest host-update notice kdrun sent to this rank (0: none).

    In an elastic job kdrun writes ``hosts-updated <n>`` to the job's standard
    input, which mpiexec forwards to rank 0's supervisor; the supervisor passes
    ``H <n>`` on through this channel. Never blocks.
    """
    channel = _get_channel()
    if channel is not None:
        try:
            while select.select([channel], [], [], 0)[0]:
                data = channel.recv(4096)
                if not data:
                    break
                _notices.extend(data.split())
        except OSError:
            pass
    numbers = [int(token) for token in _notices if token.isdigit()]
    return max(numbers, default=0)
