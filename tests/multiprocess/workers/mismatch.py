"""Ranks call mismatched collectives on purpose; every rank must get an error.

Usage: mismatch.py SCENARIO. Rank 0 and the other ranks disagree in the way the
scenario names. Each rank prints "MISMATCH rank=R: <message>" when it gets the
error, or "NO ERROR rank=R" (a failure) when the call returned.
"""

import sys

import numpy as np

import keras_dist as kd

kd.init()
RANK = kd.rank()
first = RANK == 0
x = np.random.default_rng(RANK).standard_normal(12).astype(np.float32)

SCENARIOS = {
    "shape": lambda: kd.allreduce(x[:10] if first else x[:12]),
    "same_count_other_shape": lambda: kd.allreduce(x.reshape(3, 4) if first else x.reshape(4, 3)),
    "dtype": lambda: kd.allreduce(x if first else x.astype(np.float64)),
    "op": lambda: kd.allreduce(x, op=kd.Sum if first else kd.Max),
    "grouped_count": lambda: kd.grouped_allreduce([x[:4], x[4:]] if first else [x]),
    "order": lambda: kd.allreduce(x) if first else kd.broadcast(x, root_rank=0),
    "root": lambda: kd.broadcast(x, root_rank=0 if first else 1),
    "allgather_shape": lambda: kd.allgather(x.reshape(3, 4) if first else x.reshape(2, 6)),
}

try:
    SCENARIOS[sys.argv[1]]()
except (kd.CollectiveMismatchError, ValueError) as error:
    print(f"MISMATCH rank={RANK}: {type(error).__name__}: {error}", flush=True)
    sys.exit(0)
print(f"NO ERROR rank={RANK}", flush=True)
sys.exit(3)
