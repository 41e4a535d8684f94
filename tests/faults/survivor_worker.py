"""Rank 1 SIGKILLs itself in the middle of a run of allreduces; the others must raise.

Run under ``mpiexec -disable-auto-cleanup``, so nothing kills the survivors for
us: each must raise PeerFailureError naming rank 1 on its own. Every rank
prints "RAISED rank=R after S s: <message>" when it does, then marks it with a
file ``raised.R`` in ``$SURVIVOR_MARKER_DIR`` and stays until every other
survivor has raised too or is gone, so that no survivor can find another
survivor's exit in place of rank 1's death. "GAVE UP rank=R" says that did
not happen within DEADLINE_SECONDS.
"""

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

import keras_dist as kd
from keras_dist._runtime.procfs import process_alive

MARKERS = Path(os.environ["SURVIVOR_MARKER_DIR"])
DEADLINE_SECONDS = 30  # under the test's 60 s limit on the whole job

kd.init()
RANK, SIZE = kd.rank(), kd.size()
PIDS = kd.allgather_object(os.getpid())
OTHER_SURVIVORS = [rank for rank in range(SIZE) if rank not in (1, RANK)]


def wait_for_the_other_survivors() -> None:
    deadline = time.monotonic() + DEADLINE_SECONDS
    while waiting := [rank for rank in OTHER_SURVIVORS if process_alive(PIDS[rank])
                      and not (MARKERS / f"raised.{rank}").exists()]:
        if time.monotonic() > deadline:
            print(f"GAVE UP rank={RANK}: ranks {waiting} neither raised nor left "
                  f"within {DEADLINE_SECONDS} s", flush=True)
            return
        time.sleep(0.01)


x = np.random.default_rng(RANK).standard_normal(1000)
for step in range(100):
    if RANK == 1 and step == 20:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    try:
        kd.allreduce(x)
    except kd.PeerFailureError as error:
        print(f"RAISED rank={RANK} after {time.monotonic() - started:.1f} s: {error}", flush=True)
        (MARKERS / f"raised.{RANK}").touch()
        wait_for_the_other_survivors()
        os._exit(3)  # the job is broken: leave without MPI_Finalize
print(f"FINISHED rank={RANK}", flush=True)
sys.exit(0)
