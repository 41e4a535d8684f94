"""Rank 1 SIGKILLs itself in the middle of a run of allreduces; the others must raise.

Run under ``mpiexec -disable-auto-cleanup``, so nothing kills the survivors for
us: each must raise PeerFailureError naming rank 1 on its own. Every rank
prints "RAISED rank=R after S s: <message>" when it does.
"""

import os
import signal
import sys
import time

import numpy as np

import keras_dist as kd

kd.init()
RANK = kd.rank()
x = np.random.default_rng(RANK).standard_normal(1000)
for step in range(100):
    if RANK == 1 and step == 20:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    try:
        kd.allreduce(x)
    except kd.PeerFailureError as error:
        print(f"RAISED rank={RANK} after {time.monotonic() - started:.1f} s: {error}", flush=True)
        time.sleep(3)  # let the other survivor find out for itself before the job ends
        os._exit(3)  # the job is broken: leave without MPI_Finalize
print(f"FINISHED rank={RANK}", flush=True)
sys.exit(0)
