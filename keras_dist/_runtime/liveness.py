"""Bounded waiting: peer liveness, stall warnings and timeouts for Python-side waits.

A transport that waits on a request it cannot interrupt (an MPI request) polls
it through ``Waiter.wait``: it spins, then yields, then sleeps between polls,
checks that the peers on this machine are still alive and have not left the
group, warns once when the wait passes the stall threshold, and raises when
it passes the timeout. The
durations are the native engine's (``WAIT_TIMINGS``), one set for every wait.
"""

from __future__ import annotations

import os
import socket
import time
import warnings
from collections.abc import Callable

# The engine's wait timings (native/src/wait_timings.h gives the reason behind
# each): one table, the native extension's, for every wait.
from keras_dist._native import WAIT_TIMINGS
from keras_dist._runtime.procfs import process_alive
from keras_dist.errors import CollectiveTimeoutError, PeerFailureError, StallWarning


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
        departed: a callable returning the ranks known to have left the
            group (closed their transport); waiting for them raises.
    """

    def __init__(self, peers, rank: int, stall_seconds: float, timeout_seconds: float | None,
                 transport: str, arrivals: Callable[[], list[int] | None] | None = None,
                 departed: Callable[[], list[int]] | None = None) -> None:
        host = socket.gethostname()
        self.rank = rank
        self.local_peers = [(r, pid) for r, h, pid in peers if h == host and r != rank]
        self.stall_seconds = stall_seconds
        self.timeout_seconds = timeout_seconds
        self.transport = transport
        self.arrivals = arrivals
        self.departed = departed

    def wait(self, test: Callable[[], bool], what: str) -> None:
        """Returns once ``test()`` is true; ``what`` names the collective in messages."""
        if test():
            return
        start = time.monotonic()
        spin_until = start + WAIT_TIMINGS["python_spin_seconds"]
        while time.monotonic() < spin_until:
            if test():
                return
        yield_until = start + WAIT_TIMINGS["yield_seconds"]
        poll_sleep = WAIT_TIMINGS["poll_sleep_seconds"]
        liveness_period = WAIT_TIMINGS["liveness_seconds"]
        next_liveness = start + liveness_period
        warned = False
        while not test():
            # Ranks may outnumber cores: yield the core, then sleep.
            now = time.monotonic()
            time.sleep(0 if now < yield_until else poll_sleep)
            if now < next_liveness:
                continue
            next_liveness = now + liveness_period
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

    def check_departed(self, what: str) -> None:
        """Raises ``PeerFailureError`` if a peer has left the group."""
        for peer in self.departed() if self.departed else ():
            raise PeerFailureError(
                f"rank {peer} has shut down keras_dist (left the group) while rank "
                f"{self.rank} waits in {what} (transport {self.transport})", peer_rank=peer,
            )

    def _check_peers(self, what: str) -> None:
        self.check_departed(what)
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
