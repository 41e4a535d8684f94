"""The NCCL transport: GPU buffers through ``cupy.cuda.nccl``.

The NCCL unique id travels over MPI (the control plane). Work is queued on a
stream of the transport's own, ordered after everything already queued on
the caller's current stream, and the caller's stream waits for it: the
synchronisation is explicit, and the host never blocks on the GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from keras_dist import _vocab
from keras_dist.errors import TransportError
from keras_dist.transports.base import Transport

# ncclDataType_t and ncclRedOp_t values (stable across NCCL 2.x releases).
_NCCL_DTYPES = {
    _vocab.UINT8: 1, _vocab.INT32: 2, _vocab.INT64: 4,
    _vocab.FLOAT16: 6, _vocab.FLOAT32: 7, _vocab.FLOAT64: 8, _vocab.BFLOAT16: 9,
}
_NCCL_OPS = {_vocab.SUM: 0, _vocab.PRODUCT: 1, _vocab.MAX: 2, _vocab.MIN: 3}


def _import_nccl():
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as error:
        raise TransportError(
            "The NCCL transport needs cupy with NCCL (pip install 'keras-dist[cuda12]'). "
            f"Received: ImportError: {error}"
        ) from error
    if not getattr(nccl, "available", True):
        raise TransportError("cupy was built without NCCL; the NCCL transport cannot run.")
    return cupy, nccl


class NcclTransport(Transport):
    """Collectives on cupy device arrays over an NCCL communicator."""

    name = "nccl"

    def __init__(self, comm, local_rank: int) -> None:
        super().__init__()
        cupy, nccl = _import_nccl()
        self._cupy, self._nccl = cupy, nccl
        device_count = cupy.cuda.runtime.getDeviceCount()
        if device_count == 0:
            raise TransportError("The NCCL transport needs a CUDA GPU; none is visible.")
        self.device = cupy.cuda.Device(local_rank % device_count)
        self.device.use()
        unique_id = nccl.get_unique_id() if comm.Get_rank() == 0 else None
        unique_id = comm.bcast(unique_id, root=0)
        self.comm = self._call(nccl.NcclCommunicator, comm.Get_size(), unique_id,
                               comm.Get_rank())
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def _call(self, function, *args):
        try:
            return function(*args)
        except self._nccl.NcclError as error:
            status = getattr(error, "status", None)
            raise TransportError(f"NCCL failed (status {status}): {error}") from error

    def _enqueue(self, launch) -> None:
        """Runs ``launch(stream_ptr)`` ordered after, and before, the caller's stream."""
        caller = self._cupy.cuda.get_current_stream()
        self.stream.wait_event(caller.record())
        self._call(launch, self.stream.ptr)
        caller.wait_event(self.stream.record())

    def _code(self, buf) -> int:
        code = _NCCL_DTYPES.get(_vocab.dtype_code(buf.dtype))
        if code is None:
            raise TypeError(f"NCCL cannot carry dtype {np.dtype(buf.dtype).name}")
        return code

    def allreduce(self, buf, op: int) -> None:
        dtype = self._code(buf)
        self._enqueue(lambda stream: self.comm.allReduce(
            buf.data.ptr, buf.data.ptr, buf.size, dtype, _NCCL_OPS[op], stream))

    def broadcast(self, buf, root: int) -> None:
        dtype = self._code(buf)
        self._enqueue(lambda stream: self.comm.bcast(buf.data.ptr, buf.size, dtype, root, stream))

    def allgatherv(self, send, recv, counts: Sequence[int]) -> None:
        # NCCL's allgather needs equal counts: pad each rank's part to the largest.
        cupy = self._cupy
        width = max(counts)
        padded_send = cupy.zeros(width, send.dtype)
        padded_send[: send.size] = send
        padded_recv = cupy.empty(width * len(counts), send.dtype)
        dtype = self._code(send)
        self._enqueue(lambda stream: self.comm.allGather(
            padded_send.data.ptr, padded_recv.data.ptr, width, dtype, stream))
        offset = 0
        for rank, count in enumerate(counts):
            recv[offset : offset + count] = padded_recv[rank * width : rank * width + count]
            offset += count

    def barrier(self) -> None:
        token = self._cupy.zeros(1, np.int32)
        self.allreduce(token, _vocab.SUM)
        self._cupy.cuda.get_current_stream().synchronize()

    def scratch(self, nbytes: int):
        if getattr(self, "_device_scratch", None) is None or self._device_scratch.nbytes < nbytes:
            self._device_scratch = self._cupy.empty(nbytes, np.uint8)
        return self._device_scratch[:nbytes]

    def close(self) -> None:
        comm, self.comm = getattr(self, "comm", None), None
        if comm is not None:
            comm.destroy()
