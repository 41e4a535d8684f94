"""keras_dist on a user's communicator: ``init(comm=COMM_WORLD.Split(...))``.

    user_comm.py reordered   every rank, group ranks in reverse world order
    user_comm.py subset      world ranks 0 and 2 only (world rank 1 does not
                             init), world rank 2 as group rank 0

Every collective is checked on every group rank against numpy float64
references computed from every group rank's data (seeded by group rank).
Prints "USER COMM OK world=W rank=R size=N transport=T" (or "OUTSIDE world=W"
for a rank left out of the group).
"""

import sys

import numpy as np
from mpi4py import MPI

import keras_dist as kd

world = MPI.COMM_WORLD
WORLD_RANK, WORLD_SIZE = world.Get_rank(), world.Get_size()
MODE = sys.argv[1]

if MODE == "reordered":
    comm = world.Split(color=0, key=WORLD_SIZE - 1 - WORLD_RANK)
elif MODE == "subset":
    inside = WORLD_RANK != 1
    comm = world.Split(color=0 if inside else MPI.UNDEFINED, key=-WORLD_RANK)
else:
    raise SystemExit(f"unknown mode {MODE!r}")

if comm == MPI.COMM_NULL:
    print(f"OUTSIDE world={WORLD_RANK}", flush=True)
    sys.exit(0)

RANK, SIZE = comm.Get_rank(), comm.Get_size()
kd.init(comm=comm)
assert (kd.rank(), kd.size()) == (RANK, SIZE), (kd.rank(), kd.size(), RANK, SIZE)
# Every rank knows every group rank's world rank: the group's order, not the world's.
assert kd.allgather_object(WORLD_RANK) == comm.allgather(WORLD_RANK)


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


REFERENCES = {
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
    for op, ref in REFERENCES.items():
        if op is kd.Average and np.dtype(dtype).kind == "i":
            continue
        for count in (1, 1000, 300_001):
            case += 1
            inputs = np.stack([data(case, r, count, dtype).astype(np.float64)
                               for r in range(SIZE)])
            got = kd.allreduce(data(case, RANK, count, dtype), op=op)
            check(f"allreduce {np.dtype(dtype).name} {op} {count}", got, ref(inputs), rtol)

# grouped_allreduce: one fused call, results in order.
parts = [data(100 + i, RANK, n) for i, n in enumerate((3, 5000, 17))]
got = kd.grouped_allreduce(parts, op=kd.Sum)
for i, n in enumerate((3, 5000, 17)):
    want = np.stack([data(100 + i, r, n) for r in range(SIZE)]).sum(0)
    check(f"grouped_allreduce part {i}", got[i], want, 1e-12)

# allgather: ragged first dimension, concatenated in group rank order.
got = kd.allgather(data(200, RANK, (RANK + 1) * 3).reshape(RANK + 1, 3))
want = np.concatenate([data(200, r, (r + 1) * 3).reshape(r + 1, 3) for r in range(SIZE)])
check("allgather", got, want, 0)

# broadcast from every group rank, small and large.
for root in range(SIZE):
    for count in (7, 1_000_003):
        got = kd.broadcast(data(300 + root, RANK, count), root_rank=root)
        check(f"broadcast root {root} count {count}", got, data(300 + root, root, count), 0)
    assert kd.broadcast_object({"from": RANK}, root_rank=root) == {"from": root}

assert kd.allgather_object(RANK) == list(range(SIZE))
kd.barrier()
transport = kd._get().transport.name
kd.shutdown()
print(f"USER COMM OK world={WORLD_RANK} rank={RANK} size={SIZE} transport={transport}",
      flush=True)
