"""A process that a cluster started: ``python self_started.py MODE``.

Modes:
    report: allreduce and allgather on random data, checked against float64
        references every rank computes itself; prints ``SELF rank=R size=N
        local=L/LS cross=C/CS ok``.
    explicit: the same, placed by ``kd.init(rendezvous=KD_TEST_RENDEZVOUS,
        rank=KD_TEST_RANK, size=KD_TEST_SIZE)`` (no cluster variables).
    loop: allreduces until rank KD_TEST_VICTIM, at the 20th, kills itself
        (KD_TEST_FAULT=kill) or raises (KD_TEST_FAULT=raise).
    mpi_first: imports mpi4py.MPI before kd.init() (a mistake kd.init names).
    restart: under torchrun --max-restarts: rank 1 raises in the first attempt
        (TORCHELASTIC_RESTART_COUNT=0); the next attempt runs ``report``.
"""

import os
import signal
import sys

import numpy as np

MODE = sys.argv[1]

if MODE == "mpi_first":
    from mpi4py import MPI  # noqa: F401

import keras_dist as kd  # noqa: E402

if MODE == "explicit":
    kd.init(rendezvous=os.environ["KD_TEST_RENDEZVOUS"], rank=int(os.environ["KD_TEST_RANK"]),
            size=int(os.environ["KD_TEST_SIZE"]))
else:
    kd.init()
rank, size = kd.rank(), kd.size()
from keras_dist._runtime import procfs  # noqa: E402

# MPICH's shared memory this rank maps (its names are removed once mapped).
mapped = sorted(name for name in procfs.mapped_files(os.getpid(), "/dev/shm/")
                if name.startswith("mpich_"))
print(f"UP rank={rank} size={size} mpich_segments={','.join(mapped)}", flush=True)

if MODE == "restart" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and rank == 1:
    raise RuntimeError("rank 1 fails in the first attempt on purpose")

if MODE in ("report", "explicit", "restart"):
    def data(r):
        return np.random.default_rng([7, r]).standard_normal(1001)

    reference = np.sum([data(r).astype(np.float64) for r in range(size)], axis=0)
    summed = kd.allreduce(data(rank), op=kd.Sum)
    np.testing.assert_allclose(summed, reference, rtol=1e-12)
    gathered = kd.allgather(data(rank)[:3].reshape(1, 3))
    np.testing.assert_array_equal(gathered, np.stack([data(r)[:3] for r in range(size)]))
    pids = kd.allgather_object(os.getpid())
    assert len(set(pids)) == size and pids[rank] == os.getpid(), pids  # one process a rank
    # kd.init() took the job's secret out of the environment of what this rank starts.
    secret_left = [name for name in ("KERAS_DIST_SECRET", "KERAS_DIST_SECRET_FILE")
                   if name in os.environ]
    print(f"SELF rank={rank} size={size} local={kd.local_rank()}/{kd.local_size()} "
          f"cross={kd.cross_rank()}/{kd.cross_size()} "
          f"attempt={os.environ.get('TORCHELASTIC_RESTART_COUNT', '-')} ok "
          f"secret_left={secret_left}", flush=True)
elif MODE == "loop":
    victim, fault = int(os.environ["KD_TEST_VICTIM"]), os.environ["KD_TEST_FAULT"]
    values = np.ones(4096)
    step = 0
    while True:
        kd.allreduce(values)
        step += 1
        if step == 20 and rank == victim:
            print(f"FAULT rank={rank} {fault}", flush=True)
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"rank {rank} fails on purpose")
