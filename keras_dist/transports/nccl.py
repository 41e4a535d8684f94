"""The NCCL transport: GPU buffers through ``cupy.cuda.nccl``.

The NCCL unique id travels over MPI (the control plane). Work is queued on a
stream of the transport's own, ordered after everything already queued on
the caller's current stream, and the caller's stream waits for it: the
synchronisation is explicit, by events (``device_queue.DeviceQueue``).
``complete`` is the one host wait, once per call of the tensor layer: bounded
(peer liveness, ``KERAS_DIST_TIMEOUT_SECONDS``, NCCL's asynchronous errors),
and on a failure the communicator is aborted (``ncclCommAbort``) and the
error raised, so a dead rank or a stall raises as on the CPU transports.

``join``: NCCL cannot reduce without every rank, and a joined rank waits in
the CPU transport's join exchange, so the NCCL transport refuses it: the
rank that calls ``join`` tells the others over MPI (a message on the
transport's own communicator) and raises; each other rank finds the message
at its next launch or while it waits, aborts its communicator and raises
with the same reason. Nobody is left waiting in NCCL.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from keras_dist import _vocab
from keras_dist._runtime.liveness import Waiter, describe_peers
from keras_dist.errors import TransportError
from keras_dist.transports.base import Transport
from keras_dist.transports.device_queue import DeviceQueue

# ncclDataType_t and ncclRedOp_t values (stable across NCCL 2.x releases).
_NCCL_DTYPES = {
    _vocab.UINT8: 1, _vocab.INT32: 2, _vocab.INT64: 4,
    _vocab.FLOAT16: 6, _vocab.FLOAT32: 7, _vocab.FLOAT64: 8, _vocab.BFLOAT16: 9,
}
_NCCL_OPS = {_vocab.SUM: 0, _vocab.PRODUCT: 1, _vocab.MAX: 2, _vocab.MIN: 3}


#: MPI tag of the message that a rank has called ``join``.
_JOIN_TAG = 1


def unavailable_reason() -> str | None:
    """None when cupy imports with NCCL and reaches a GPU (what the NCCL
    transport needs), else why not."""
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as error:
        return ("the NCCL transport needs cupy with NCCL (pip install cupy-cuda12x "
                "nvidia-nccl-cu12, or the cuda13 pair: the extras cuda12 and cuda13 of "
                f"keras_dist's pyproject.toml). Received: ImportError: {error}")
    if not getattr(nccl, "available", True):
        return (f"cupy {cupy.__version__} found no NCCL library (pip install "
                "nvidia-nccl-cu12 or nvidia-nccl-cu13, the one matching cupy's CUDA)")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # noqa: BLE001 - cupy raises its own CUDA errors
        return f"cupy {cupy.__version__} cannot use CUDA ({type(error).__name__}: {error})"
    return None if count > 0 else f"cupy {cupy.__version__} sees no GPU"


def gpu_identity(device_id: int) -> str:
    """A name of GPU ``device_id`` unique on this machine (its PCI bus id)."""
    import cupy

    return cupy.cuda.Device(device_id).pci_bus_id


def _import_nccl():
    reason = unavailable_reason()
    if reason is not None:
        raise TransportError(reason)
    import cupy
    from cupy.cuda import nccl

    return cupy, nccl


def create_communicator(nccl, device, size: int, unique_id, rank: int, waiter: Waiter):
    """``nccl.NcclCommunicator(size, unique_id, rank)`` on ``device``, bounded as a collective.

    NCCL's communicator creation blocks until every rank has called it, and
    cannot be interrupted. It runs in a helper thread (which makes ``device``
    its current GPU first: the communicator binds to the calling thread's
    device) while this thread waits as every keras_dist wait does: a local
    peer that dies raises ``PeerFailureError``, and ``KERAS_DIST_TIMEOUT_SECONDS``
    bounds the wait (``CollectiveTimeoutError``). The helper stays blocked in
    NCCL after such an error; the job ends on it (kdrun stops every rank).
    """
    made: dict = {}

    def make() -> None:
        try:
            device.use()
            made["comm"] = nccl.NcclCommunicator(size, unique_id, rank)
        except BaseException as error:  # noqa: BLE001 - re-raised in the waiting thread
            made["error"] = error

    helper = threading.Thread(target=make, name="keras_dist-nccl-init", daemon=True)
    helper.start()
    waiter.wait(lambda: not helper.is_alive(), "creating the NCCL communicator")
    if "error" in made:
        raise made["error"]
    return made["comm"]


class NcclTransport(Transport):
    """Collectives on cupy device arrays over an NCCL communicator.

    Args:
        comm: the group's MPI communicator (the unique id travels over it).
        device_id: the GPU of this rank's values (the communicator's, for
            good: each rank must have a GPU of its own).
        config: the process's ``Config`` (stall warning and timeout of ``complete``).
        rank_names: what messages call each rank of ``comm`` (default: its rank).
    """

    name = "nccl"

    def __init__(self, comm, device_id: int, config,
                 rank_names: Sequence[int] | None = None) -> None:
        super().__init__()
        cupy, nccl = _import_nccl()
        self._cupy, self._nccl = cupy, nccl
        self.rank = comm.Get_rank()
        self._rank_names = list(rank_names) if rank_names is not None else \
            list(range(comm.Get_size()))
        self.device = cupy.cuda.Device(device_id)
        unique_id = nccl.get_unique_id() if self.rank == 0 else None
        unique_id = comm.bcast(unique_id, root=0)
        self._notices = comm.Dup()  # join notices (module docstring)
        self._sent: list = []
        self._join_reason: str | None = None
        peers = describe_peers(comm)
        waiter = Waiter(peers, self.rank, config.stall_check_seconds,
                        config.timeout_seconds, self.name)
        try:
            self.comm = create_communicator(nccl, self.device, comm.Get_size(), unique_id,
                                            self.rank, waiter)
        except (nccl.NcclError, KeyError) as error:
            status = error.args[0] if isinstance(error, KeyError) else error.status
            raise TransportError(f"NCCL failed to create its communicator on rank "
                                 f"{self._rank_names[self.rank]} (status {status}): "
                                 f"{error}") from error
        with self.device:
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self.queue = DeviceQueue(self.stream, cupy.cuda.get_current_stream, self.comm, waiter,
                                 nccl.NcclError, self.rank, self.name,
                                 new_event=lambda: cupy.cuda.Event(disable_timing=True),
                                 interrupted=self._peer_joined)

    def _peer_joined(self) -> str | None:
        """Why collectives cannot go on, once a peer has called ``join`` (else None)."""
        if self._join_reason is None:
            from mpi4py import MPI

            status = MPI.Status()
            if self._notices.iprobe(source=MPI.ANY_SOURCE, tag=_JOIN_TAG, status=status):
                self._join_reason = _join_refusal(self._rank_names[status.Get_source()])
        return self._join_reason

    def refuse_join(self, rank: int) -> str | None:
        for peer in range(len(self._rank_names)):
            if peer != self.rank:
                self._sent.append(self._notices.isend(self.rank, dest=peer, tag=_JOIN_TAG))
        reason = _join_refusal(self._rank_names[self.rank])
        self.queue.abort(reason)
        return reason

    def _enqueue(self, launch, what: str) -> None:
        """Runs ``launch(stream_ptr)`` ordered after, and before, the caller's stream."""
        self.queue.launch(launch, what)

    def complete(self, what: str) -> None:
        self.queue.complete(what)

    def _code(self, buf) -> int:
        """NCCL's dtype code for ``buf``, checked to be on this communicator's GPU."""
        if buf.device.id != self.device.id:
            raise ValueError(
                f"The NCCL communicator of this rank uses GPU {self.device.id}, the GPU of its "
                "first GPU collective; every GPU value of a rank must be on that GPU (pin "
                "each rank to one GPU: kdrun --gpu-per-rank, torch.cuda.set_device("
                "kd.local_rank()), tf.config.set_visible_devices(...), ...). Received: a "
                f"value on GPU {buf.device.id}")
        code = _NCCL_DTYPES.get(_vocab.dtype_code(buf.dtype))
        if code is None:
            raise TypeError(f"NCCL cannot carry dtype {np.dtype(buf.dtype).name}")
        return code

    def allreduce(self, buf, op: int, name: str | None = None, send=None) -> None:
        if send is not None:
            buf[...] = send
        dtype = self._code(buf)
        self._enqueue(lambda stream: self.comm.allReduce(
            buf.data.ptr, buf.data.ptr, buf.size, dtype, _NCCL_OPS[op], stream),
            f"allreduce op={_vocab.OP_NAMES[op]} dtype={buf.dtype.name} count={buf.size} "
            f"{name or ''}")

    def broadcast(self, buf, root: int, name: str | None = None) -> None:
        dtype = self._code(buf)
        self._enqueue(lambda stream: self.comm.bcast(buf.data.ptr, buf.size, dtype, root, stream),
                      f"broadcast root={root} bytes={buf.nbytes} {name or ''}")

    def allgatherv(self, send, recv, counts: Sequence[int], name: str | None = None) -> None:
        # NCCL's allgather needs equal counts: pad each rank's part to the largest.
        cupy = self._cupy
        width = max(counts)
        with self.device:
            padded_send = cupy.zeros(width, send.dtype)
            padded_send[: send.size] = send
            padded_recv = cupy.empty(width * len(counts), send.dtype)
        dtype = self._code(send)
        self._enqueue(lambda stream: self.comm.allGather(
            padded_send.data.ptr, padded_recv.data.ptr, width, dtype, stream),
            f"allgather dtype={send.dtype.name} counts={list(counts)} {name or ''}")
        offset = 0
        for rank, count in enumerate(counts):
            recv[offset : offset + count] = padded_recv[rank * width : rank * width + count]
            offset += count

    def barrier(self) -> None:
        with self.device:
            token = self._cupy.zeros(1, np.int32)
        self.allreduce(token, _vocab.SUM, name="barrier")
        self.complete("barrier")

    def scratch(self, nbytes: int):
        if getattr(self, "_device_scratch", None) is None or self._device_scratch.nbytes < nbytes:
            with self.device:
                self._device_scratch = self._cupy.empty(nbytes, np.uint8)
        return self._device_scratch[:nbytes]

    def close(self) -> None:
        comm, self.comm = getattr(self, "comm", None), None
        if comm is not None and self.queue.failure is None:  # an aborted one is freed
            comm.destroy()
        notices, self._notices = getattr(self, "_notices", None), None
        if notices is not None:
            notices.Free()


def _join_refusal(rank: int) -> str:
    return (f"rank {rank} called join(), and NCCL cannot reduce GPU values without every "
            "rank. Set KERAS_DIST_GPU_OPERATIONS=mpi (GPU values staged through host "
            "memory, where join works), or give every rank the same number of steps")
