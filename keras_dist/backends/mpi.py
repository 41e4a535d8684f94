"""The MPI transport: mpi4py's buffer interface, no pickling of arrays."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from keras_dist import _dtypes
from keras_dist.backends.base import Transport


class MpiTransport(Transport):
    """Collectives over an mpi4py communicator.

    float16 and bfloat16 have no MPI datatype: they travel as float32, so the
    sum is accumulated in float32 and rounded once, as the native kernels do.
    """

    name = "mpi"

    def __init__(self, comm) -> None:
        super().__init__()
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm
        self._ops = {
            _dtypes.SUM: MPI.SUM,
            _dtypes.MIN: MPI.MIN,
            _dtypes.MAX: MPI.MAX,
            _dtypes.PRODUCT: MPI.PROD,
        }

    def allreduce(self, buf: np.ndarray, op: int) -> None:
        mpi_op = self._ops[op]
        if _dtypes.is_half(buf.dtype):
            wide = buf.astype(np.float32)
            self.comm.Allreduce(self._mpi.IN_PLACE, wide, mpi_op)
            buf[...] = wide.astype(buf.dtype)
        else:
            self.comm.Allreduce(self._mpi.IN_PLACE, buf, mpi_op)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        self.comm.Bcast(buf.view(np.uint8), root=root)

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> None:
        itemsize = send.dtype.itemsize
        byte_counts = [c * itemsize for c in counts]
        displacements = np.concatenate([[0], np.cumsum(byte_counts)[:-1]]).tolist()
        self.comm.Allgatherv(
            send.view(np.uint8), [recv.view(np.uint8), byte_counts, displacements, self._mpi.BYTE]
        )

    def barrier(self) -> None:
        self.comm.Barrier()
