"""Rank 1 joins a collective late (or never); the others must warn, then time out.

Usage: stall.py late|never, with ``STALL_FLAGS`` a directory the ranks share.
With "late", rank 1 joins only once every other rank has warned: a waiting
rank's ``StallWarning`` prints "STALL WARNING rank=R: <message>" and leaves a
file ``warned-R`` in ``STALL_FLAGS``, which rank 1 waits for; the collective
then completes. With "never", rank 1 never joins and waits until the job is
ended: the others raise CollectiveTimeoutError ("TIMEOUT rank=R: ..."),
which, unhandled, ends the job.
"""

import os
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np

import keras_dist as kd

kd.init()
RANK, SIZE = kd.rank(), kd.size()
mode = sys.argv[1]
flags = Path(os.environ["STALL_FLAGS"])
x = np.arange(10, dtype=np.float64) + RANK


def show(message, category, *args, **kwargs):
    if issubclass(category, kd.StallWarning):
        print(f"STALL WARNING rank={RANK}: {message}", flush=True)
        (flags / f"warned-{RANK}").touch()


with warnings.catch_warnings():
    warnings.simplefilter("always", kd.StallWarning)
    warnings.showwarning = show
    if RANK == 1:
        if mode == "never":
            threading.Event().wait()  # never joins; the job ends when the others fail
        # Joins once every other rank has warned (the job's hard timeout bounds this).
        while not all((flags / f"warned-{r}").exists() for r in range(SIZE) if r != 1):
            time.sleep(0.01)
    try:
        result = kd.allreduce(x, op=kd.Sum)
    except kd.CollectiveTimeoutError as error:
        print(f"TIMEOUT rank={RANK}: {error}", flush=True)
        raise  # unhandled: keras_dist aborts the whole job
expected = np.arange(10) * SIZE + SIZE * (SIZE - 1) / 2
assert np.array_equal(result, expected), result
print(f"DONE rank={RANK}", flush=True)
