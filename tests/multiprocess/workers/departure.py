"""Rank 0 shuts keras_dist down while the others still call collectives.

Usage: departure.py MODE. MODE "after": rank 0 calls ``kd.shutdown()``, the
others start an allreduce afterwards. MODE "waiting": the others are already
waiting in an allreduce when rank 0 shuts down. Rank 0 then stays alive (its
pid keeps passing the liveness check) for a while. Every other rank must get
``PeerFailureError`` naming rank 0 within a couple of seconds, and prints
"DEPARTED rank=R seconds=S: <message>".
"""

from __future__ import annotations

import sys
import time

import numpy as np

import keras_dist as kd

MODE = sys.argv[1]
kd.init()
RANK = kd.rank()
x = np.random.default_rng(RANK).standard_normal(8).astype(np.float32)
kd.allreduce(x)  # everyone is in the group
kd.barrier()

if RANK == 0:
    if MODE == "waiting":
        time.sleep(0.5)  # the others are in their allreduce by now
    kd.shutdown()
    print("SHUT DOWN rank=0", flush=True)
    time.sleep(4)
    sys.exit(0)

if MODE == "after":
    time.sleep(0.5)  # rank 0 has left by now
start = time.monotonic()
try:
    kd.allreduce(x)
except kd.PeerFailureError as error:
    waited = time.monotonic() - start
    assert "rank 0 has shut down keras_dist (left the group)" in str(error), error
    assert error.peer_rank == 0, (error.peer_rank, error)
    assert waited < 2.5, waited
    print(f"DEPARTED rank={RANK} seconds={waited:.2f}: {error}", flush=True)
    sys.exit(0)
print(f"NO ERROR rank={RANK}", flush=True)
sys.exit(3)
