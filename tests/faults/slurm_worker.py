"""A rank of a kdrun job inside a Slurm job (test_slurm.py).

Runs allreduce (sum and average), allgather and broadcast on random float32
data and checks each result against a numpy float64 reference built from
every rank's data (each rank draws every rank's data from the same seeds).
Prints one line ``REPORT {json}`` with the rank's topology, the Slurm step it
was started in (hydra's proxies run as a Slurm step when kdrun launches
through Slurm) and the largest error of each collective.
"""

import json
import os
import socket

import numpy as np

import keras_dist as kd

SEED = 1234
COUNT = 10007  # not a multiple of any bucket or vector width


def rank_data(rank: int) -> np.ndarray:
    return np.random.default_rng([SEED, rank]).standard_normal(COUNT).astype(np.float32)


def gather_rows(rank: int) -> np.ndarray:
    return np.random.default_rng([SEED, 1000 + rank]).standard_normal(
        (rank + 1, 3)).astype(np.float32)


kd.init()
rank, size = kd.rank(), kd.size()
every = np.stack([rank_data(r).astype(np.float64) for r in range(size)])

total = kd.allreduce(rank_data(rank), op=kd.Sum)
average = kd.allreduce(rank_data(rank), op=kd.Average)
gathered = kd.allgather(gather_rows(rank))
root = size - 1
broadcast = kd.broadcast(rank_data(rank), root_rank=root)

expected_gather = np.concatenate([gather_rows(r) for r in range(size)])
report = {
    "rank": rank,
    "size": size,
    "host": socket.gethostname(),
    "local_rank": kd.local_rank(),
    "local_size": kd.local_size(),
    "cross_rank": kd.cross_rank(),
    "cross_size": kd.cross_size(),
    "slurm_step_id": os.environ.get("SLURM_STEP_ID"),
    "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    "sum_error": float(np.max(np.abs(total - every.sum(axis=0)))),
    "average_error": float(np.max(np.abs(average - every.mean(axis=0)))),
    "allgather_exact": bool(gathered.shape == expected_gather.shape
                            and np.array_equal(gathered, expected_gather)),
    "broadcast_exact": bool(np.array_equal(broadcast, rank_data(root))),
    "dtypes": [str(total.dtype), str(average.dtype)],
}
kd.barrier()
print("REPORT " + json.dumps(report), flush=True)
kd.shutdown()
