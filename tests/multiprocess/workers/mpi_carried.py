"""The MPI transport's small allreduces, which travel in their call's check
(``MpiTransport.CARRIED_BYTES``), against a float64 reference: every op,
dtypes from int8 to float64 (float16 takes MPI's path), sizes on both sides
of the limit, a 2-d array, then a mismatch that must raise on every rank and
leave the group usable. Prints ``CARRIED OK rank=R transport=T`` at the end.
"""

import numpy as np

import keras_dist as kd
from keras_dist.transports.mpi import CARRIED_BYTES

kd.init()
rank, size = kd.rank(), kd.size()
REFERENCE = {kd.Sum: np.sum, kd.Min: np.min, kd.Max: np.max, kd.Product: np.prod}
for dtype in (np.int8, np.uint8, np.int32, np.int64, np.float16, np.float32, np.float64):
    limit = CARRIED_BYTES // np.dtype(dtype).itemsize
    for count in (1, 3, limit, limit + 1, 100):
        for op, reference in REFERENCE.items():
            values = [(np.arange(count) % 5 + r + 1).astype(dtype) for r in range(size)]
            got = kd.allreduce(values[rank], op=op)
            wide = reference(np.stack([v.astype(np.float64) for v in values]), axis=0)
            assert got.dtype == np.dtype(dtype) and np.array_equal(got, wide.astype(dtype)), (
                dtype, count, op, got, wide)
matrix = kd.allreduce(np.full((2, 3), rank + 1, np.float32), op=kd.Sum)
assert matrix.shape == (2, 3) and np.all(matrix == size * (size + 1) // 2), matrix
try:
    kd.allreduce(np.ones(3 + rank, np.float32), op=kd.Sum)
    raise AssertionError("a count mismatch did not raise")
except kd.CollectiveMismatchError as error:
    assert "count=3" in str(error) and "count=4" in str(error), error
assert np.all(kd.allreduce(np.ones(2, np.float32), op=kd.Sum) == size)
print(f"CARRIED OK rank={rank} transport={kd._get().transport.name}", flush=True)
