"""Bounded waiting: peer liveness, stall warnings and timeouts for Python-side waits.

A transport that waits on a request it cannot interrupt (an MPI request) polls
it through ``Waiter.wait``: it backs off from spinning to short sleeps, checks
that the peers on this machine are still alive, warns once when the wait
passes the stall threshold, and raises when it passes the timeout.
"""

from __future__ import annotations

import os
import socket
import time
import warnings
from collections.abc import Callable

from keras_dist._runtime.procfs import process_alive
from keras_dist.errors import CollectiveTimeoutError, PeerFailureError, StallWarning

_LIVENESS_PERIOD_S = 0.2
_SPIN_POLLS = 2000
_YIELD_POLLS = 20000


class Waiter:
    """Polls a request until it completes, or raises naming what went wrong.

    Args:
        peers: ``(rank, host, pid)`` of every rank of the group.
        rank: this process's rank.
        stall_seconds: warn after this long (0: never).
        timeout_seconds: raise after this long (None: never).
        transport: the transport's name, for messages.
        arrivals: a callable returning the list of ranks known not to have
            joined the collective yet, or None when that cannot be known.
    """

    def __init__(self, peers, rank: int, stall_seconds: float, timeout_seconds: float | None,
                 transport: str, arrivals: Callable[[], list[int] | None] | None = None) -> None:
        host = socket.gethostname()
        self.rank = rank
        self.local_peers = [(r, pid) for r, h, pid in peers if h == host and r != rank]
        self.stall_seconds = stall_seconds
        self.timeout_seconds = timeout_seconds
        self.transport = transport
        self.arrivals = arrivals

    def wait(self, test: Callable[[], bool], what: str) -> None:
        """Returns once ``test()`` is true; ``what`` names the collective in messages."""
        if test():
            return
        start = time.monotonic()
        next_liveness = start + _LIVENESS_PERIOD_S
        warned = False
        polls = 0
        while not test():
            # Spin first (small collectives end within microseconds), then
            # yield the core, then sleep: ranks may outnumber cores.
            polls += 1
            if polls > _SPIN_POLLS:
                time.sleep(0 if polls < _YIELD_POLLS else 2e-4)
            now = time.monotonic()
            if now >= next_liveness:
                next_liveness = now + _LIVENESS_PERIOD_S
                self._check_peers(what)
            waited = now - start
            if not warned and self.stall_seconds and waited >= self.stall_seconds:
                warned = True
                warnings.warn(StallWarning(self._stall_message(what, waited)), stacklevel=3)
            if self.timeout_seconds is not None and waited >= self.timeout_seconds:
                raise CollectiveTimeoutError(
                    f"{what} timed out on rank {self.rank} after {waited:.1f} s "
                    f"(KERAS_DIST_TIMEOUT_SECONDS={self.timeout_seconds:g}, transport "
                    f"{self.transport}); {self._missing_text()}"
                )

    def _check_peers(self, what: str) -> None:
        for peer, pid in self.local_peers:
            if not process_alive(pid):
                raise PeerFailureError(
                    f"rank {peer} (pid {pid}) died while rank {self.rank} waited in {what} "
                    f"(transport {self.transport})", peer_rank=peer,
                )

    def _missing_text(self) -> str:
        missing = self.arrivals() if self.arrivals else None
        if missing is None:
            return "ranks that have not joined: unknown (they run on other machines)"
        return f"ranks that have not joined: {missing}"

    def _stall_message(self, what: str, waited: float) -> str:
        return (
            f"rank {self.rank} has waited {waited:.0f} s in {what} (transport "
            f"{self.transport}); {self._missing_text()}. A rank that skipped or reordered "
            "a collective makes the others wait forever; set KERAS_DIST_TIMEOUT_SECONDS to "
            "turn this into an error."
        )


def describe_peers(comm) -> list[tuple[int, str, int]]:
    """``(rank, host, pid)`` of every rank of ``comm`` (collective)."""
    found = comm.allgather((socket.gethostname(), os.getpid()))
    return [(rank, host, pid) for rank, (host, pid) in enumerate(found)]
