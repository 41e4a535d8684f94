"""Rank 1 joins a collective late (or never); the others must warn, then time out.

Usage: stall.py late|never. With "late", rank 1 sleeps past the stall threshold
before joining: the waiting ranks print "STALL WARNING rank=R: <message>" and
the collective completes. With "never", rank 1 skips the collective and waits
in a barrier: the others raise CollectiveTimeoutError ("TIMEOUT rank=R: ..."),
which, unhandled, ends the job.
"""

import sys
import time
import warnings

import numpy as np

import keras_dist as kd

kd.init()
RANK, SIZE = kd.rank(), kd.size()
mode = sys.argv[1]
x = np.arange(10, dtype=np.float64) + RANK

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", kd.StallWarning)
    if RANK == 1:
        if mode == "never":
            time.sleep(60)  # never joins; the job ends when the others fail
            sys.exit(0)
        time.sleep(4)
    try:
        result = kd.allreduce(x, op=kd.Sum)
    except kd.CollectiveTimeoutError as error:
        print(f"TIMEOUT rank={RANK}: {error}", flush=True)
        raise  # unhandled: keras_dist aborts the whole job
for warning in caught:
    if issubclass(warning.category, kd.StallWarning):
        print(f"STALL WARNING rank={RANK}: {warning.message}", flush=True)
expected = np.arange(10) * SIZE + SIZE * (SIZE - 1) / 2
assert np.array_equal(result, expected), result
print(f"DONE rank={RANK}", flush=True)
