"""Rank 1 joins a collective late (or never); the others must warn, then time out.

Usage: stall.py late TRANSPORT [TRANSPORT ...] | stall.py never, with
``STALL_FLAGS`` a directory the ranks share. With "late", one case per
transport (``KERAS_DIST_CPU_OPERATIONS``, its own ``init`` and ``shutdown``),
each reported by name (tests/multiprocess/workers/_checks.py): rank 1 joins
only once every other rank has warned: a waiting rank's ``StallWarning``
prints "STALL WARNING case=T rank=R: <message>" and leaves a file
``T/warned-R`` in ``STALL_FLAGS``, which rank 1 waits for; the collective then
completes ("DONE case=T rank=R"). With "never" (the job's transport), rank 1
never joins and waits until the job is ended: the others raise
CollectiveTimeoutError ("TIMEOUT rank=R: ..."), which, unhandled, ends the job.
"""

import os
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
from mpi4py import MPI

import keras_dist as kd
from tests.multiprocess.workers._checks import run_checks

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
mode = sys.argv[1]


def allreduce_with_rank_1(flags: Path, case: str) -> None:
    """One allreduce that rank 1 joins late (``late``) or never; checks its result."""
    flags.mkdir(parents=True, exist_ok=True)
    x = np.arange(10, dtype=np.float64) + RANK

    def show(message, category, *args, **kwargs):
        if issubclass(category, kd.StallWarning):
            print(f"STALL WARNING case={case} rank={RANK}: {message}", flush=True)
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
    print(f"DONE case={case} rank={RANK}", flush=True)


def late_on(transport: str):
    def check():
        os.environ["KERAS_DIST_CPU_OPERATIONS"] = transport
        kd.init()
        try:
            allreduce_with_rank_1(Path(os.environ["STALL_FLAGS"]) / transport, transport)
        finally:
            kd.shutdown()

    check.__name__ = transport
    return check


if mode == "never":
    kd.init()
    allreduce_with_rank_1(Path(os.environ["STALL_FLAGS"]), os.environ["KERAS_DIST_CPU_OPERATIONS"])
else:
    run_checks([late_on(transport) for transport in sys.argv[2:]], rank=RANK,
               agree=MPI.COMM_WORLD.allgather)
