"""Rank 0 shuts keras_dist down while the others still call collectives.

Usage: departure.py MODE. MODE "after": the others start an allreduce once
rank 0 is in ``kd.shutdown()`` (which, on the mpi transport, returns only when
they close theirs too: no later point can be signalled). MODE "waiting": rank 0
shuts down once every other rank waits for it in an allreduce (each says so
with its first ``StallWarning``, due 0.1 s into the wait). Rank 0 then stays
alive (its pid keeps passing the liveness check) until every other rank is
done, so that only its departure can end their wait. Every other rank must get
``PeerFailureError`` naming rank 0 as departed (neither dead nor timed out),
and prints "DEPARTED rank=R seconds=S: <message>".

The ranks tell each other these events with files in a directory rank 0 makes;
each wait for one fails after ``DEADLINE_SECONDS``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

import keras_dist as kd

MODE = sys.argv[1]
#: Longest wait for another rank's marker: past the others' collective timeout
#: (KERAS_DIST_TIMEOUT_SECONDS=30 in the test), under the job's 90 s.
DEADLINE_SECONDS = 60
os.environ["KERAS_DIST_STALL_CHECK_SECONDS"] = "0.1"
warnings.simplefilter("ignore", kd.StallWarning)  # but in the allreduce rank 0 leaves
kd.init()
RANK, SIZE = kd.rank(), kd.size()
x = np.random.default_rng(RANK).standard_normal(8).astype(np.float32)
kd.allreduce(x)  # everyone is in the group
MARKERS = Path(kd.broadcast_object(tempfile.mkdtemp() if RANK == 0 else None, 0))
kd.barrier()


def wait_for(names: list[str]) -> None:
    """Returns once the marker files ``names`` exist; raises after ``DEADLINE_SECONDS``."""
    deadline = time.monotonic() + DEADLINE_SECONDS
    while missing := [name for name in names if not (MARKERS / name).exists()]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {RANK} waited {DEADLINE_SECONDS} s for {missing}")
        time.sleep(0.01)


@contextlib.contextmanager
def marking_a_wait(name: str):
    """Creates the marker ``name`` when a collective in the block warns that it waits."""
    shown = warnings.showwarning

    def show(message, category, *args, **kwargs):
        if issubclass(category, kd.StallWarning):
            (MARKERS / name).touch()
        else:
            shown(message, category, *args, **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("always", kd.StallWarning)
        warnings.showwarning = show
        yield


OTHERS = range(1, SIZE)
if RANK == 0:
    try:
        if MODE == "waiting":
            wait_for([f"waiting.{rank}" for rank in OTHERS])
        (MARKERS / "shutting-down").touch()
        kd.shutdown()
        print("SHUT DOWN rank=0", flush=True)
        wait_for([f"done.{rank}" for rank in OTHERS])
    finally:
        shutil.rmtree(MARKERS)
    sys.exit(0)

try:
    if MODE == "after":
        wait_for(["shutting-down"])
    start = time.monotonic()
    try:
        with marking_a_wait(f"waiting.{RANK}"):
            kd.allreduce(x)
    except kd.PeerFailureError as error:
        waited = time.monotonic() - start
        assert "rank 0 has shut down keras_dist (left the group)" in str(error), error
        assert error.peer_rank == 0, (error.peer_rank, error)
        print(f"DEPARTED rank={RANK} seconds={waited:.2f}: {error}", flush=True)
        sys.exit(0)
    print(f"NO ERROR rank={RANK}", flush=True)
    sys.exit(3)
finally:
    (MARKERS / f"done.{RANK}").touch()
