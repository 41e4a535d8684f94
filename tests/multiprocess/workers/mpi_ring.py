"""The MPI transport's pipelined ring (``keras_dist.transports.ring``) on
pretend machines of one rank each (``KERAS_DIST_RANKS_PER_NODE=1``), with
its size threshold and segments made small so that small arrays take it:
every op, several dtypes, counts that do not divide by the ranks, a separate
send buffer (``kd.allreduce``'s path), against a float64 reference. Prints
``RING OK rank=R size=N ring=True`` at the end.
"""

import numpy as np

import keras_dist as kd
from keras_dist.transports import mpi, ring

mpi.RING_MIN_BYTES = 64
ring.SEGMENT_BYTES = 40  # several segments per chunk, the last one short

kd.init()
rank, size = kd.rank(), kd.size()
transport = kd._get().transport.inner
REFERENCE = {kd.Sum: np.sum, kd.Min: np.min, kd.Max: np.max, kd.Product: np.prod}
for dtype in (np.int32, np.int64, np.float32, np.float64):
    for count in (16, 17, 101, 1000):
        for op, reference in REFERENCE.items():
            values = [((np.arange(count) * 7 + r) % 5 + 1).astype(dtype) for r in range(size)]
            got = kd.allreduce(values[rank], op=op)
            wide = reference(np.stack([v.astype(np.float64) for v in values]), axis=0)
            assert np.array_equal(got, wide.astype(dtype)), (dtype, count, op, got, wide)
            everyone = kd.allgather(got.reshape(1, -1))
            assert all(np.array_equal(row, got) for row in everyone), "ranks disagree"
print(f"RING OK rank={rank} size={size} ring={transport._ring}", flush=True)
