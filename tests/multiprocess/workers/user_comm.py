"""keras_dist on a user's communicator: ``init(comm=COMM_WORLD.Split(...))``.

    user_comm.py CASE [CASE ...]     each CASE "MODE TRANSPORT [RANKS_PER_NODE]"

    reordered   every rank, group ranks in reverse world order
    subset      world ranks 0 and 2 only (world rank 1 does not init),
                world rank 2 as group rank 0

The cases run one after another in the one job, each with its own ``init``
(``KERAS_DIST_CPU_OPERATIONS=TRANSPORT``, ``KERAS_DIST_RANKS_PER_NODE``) and
``shutdown``, each reported by name (tests/multiprocess/workers/_checks.py).
Every collective is checked on every group rank against numpy float64
references computed from every group rank's data (seeded by group rank).
Prints "USER COMM OK case=C world=W rank=R size=N transport=T" (or
"OUTSIDE case=C world=W" for a rank left out of the group).
"""

import os
import sys

import numpy as np
from mpi4py import MPI

import keras_dist as kd
from tests.multiprocess.workers._checks import run_checks

world = MPI.COMM_WORLD
WORLD_RANK, WORLD_SIZE = world.Get_rank(), world.Get_size()


def data(case, rank, count, dtype=np.float64):
    rng = np.random.default_rng([case, rank])
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-1000, 1000, count).astype(dtype)
    return rng.uniform(0.5, 1.5, count).astype(dtype)


def check(label, got, want, rtol):
    got = np.asarray(got)
    assert got.shape == want.shape, f"{label}: shape {got.shape}, expected {want.shape}"
    ok = np.allclose(got.astype(np.float64), want, rtol=rtol, atol=0)
    assert ok, f"{label}: max error {np.max(np.abs(got.astype(np.float64) - want))}"


def run_case(label):
    """Runs case ``label`` ("MODE TRANSPORT [RANKS_PER_NODE]") on this rank."""
    mode, transport, *ranks_per_node = label.split()
    os.environ["KERAS_DIST_CPU_OPERATIONS"] = transport
    if ranks_per_node:
        os.environ["KERAS_DIST_RANKS_PER_NODE"] = ranks_per_node[0]
    else:
        os.environ.pop("KERAS_DIST_RANKS_PER_NODE", None)
    if mode == "reordered":
        comm = world.Split(color=0, key=WORLD_SIZE - 1 - WORLD_RANK)
    elif mode == "subset":
        inside = WORLD_RANK != 1
        comm = world.Split(color=0 if inside else MPI.UNDEFINED, key=-WORLD_RANK)
    else:
        raise ValueError(f"unknown mode {mode!r}")

    if comm == MPI.COMM_NULL:
        print(f"OUTSIDE case={label} world={WORLD_RANK}", flush=True)
        return

    kd.init(comm=comm)
    try:
        name = check_collectives(comm)
    finally:
        kd.shutdown()
    print(f"USER COMM OK case={label} world={WORLD_RANK} rank={comm.Get_rank()} "
          f"size={comm.Get_size()} transport={name}", flush=True)


def check_collectives(comm):
    """Checks every collective on the group of ``comm`` against numpy; returns the
    name of the group's transport."""
    rank, size = comm.Get_rank(), comm.Get_size()
    assert (kd.rank(), kd.size()) == (rank, size), (kd.rank(), kd.size(), rank, size)
    # Every rank knows every group rank's world rank: the group's order, not the world's.
    assert kd.allgather_object(WORLD_RANK) == comm.allgather(WORLD_RANK)

    references = {
        kd.Sum: lambda w: w.sum(0),
        kd.Average: lambda w: w.mean(0),
        kd.Min: lambda w: w.min(0),
        kd.Max: lambda w: w.max(0),
        kd.Product: lambda w: w.prod(0),
    }
    # allreduce: every op, float32/float64/int64/float16, sizes on every path.
    case = 0
    for dtype, rtol in ((np.float64, 1e-12), (np.float32, 1e-5), (np.float16, 3e-3),
                        (np.int64, 0)):
        for op, ref in references.items():
            if op is kd.Average and np.dtype(dtype).kind == "i":
                continue
            for count in (1, 1000, 300_001):
                case += 1
                inputs = np.stack([data(case, r, count, dtype).astype(np.float64)
                                   for r in range(size)])
                got = kd.allreduce(data(case, rank, count, dtype), op=op)
                check(f"allreduce {np.dtype(dtype).name} {op} {count}", got, ref(inputs), rtol)

    # grouped_allreduce: one fused call, results in order.
    parts = [data(100 + i, rank, n) for i, n in enumerate((3, 5000, 17))]
    got = kd.grouped_allreduce(parts, op=kd.Sum)
    for i, n in enumerate((3, 5000, 17)):
        want = np.stack([data(100 + i, r, n) for r in range(size)]).sum(0)
        check(f"grouped_allreduce part {i}", got[i], want, 1e-12)

    # allgather: ragged first dimension, concatenated in group rank order.
    got = kd.allgather(data(200, rank, (rank + 1) * 3).reshape(rank + 1, 3))
    want = np.concatenate([data(200, r, (r + 1) * 3).reshape(r + 1, 3) for r in range(size)])
    check("allgather", got, want, 0)

    # broadcast from every group rank, small and large.
    for root in range(size):
        for count in (7, 1_000_003):
            got = kd.broadcast(data(300 + root, rank, count), root_rank=root)
            check(f"broadcast root {root} count {count}", got, data(300 + root, root, count), 0)
        assert kd.broadcast_object({"from": rank}, root_rank=root) == {"from": root}

    assert kd.allgather_object(rank) == list(range(size))
    kd.barrier()
    return kd._get().transport.name


def case_check(label):
    def check_case():
        run_case(label)

    check_case.__name__ = label
    return check_case


run_checks([case_check(label) for label in sys.argv[1:]], rank=WORLD_RANK,
           agree=world.allgather)
