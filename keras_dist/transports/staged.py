"""GPU buffers through a CPU transport, staged in host memory.

What ``KERAS_DIST_GPU_OPERATIONS=mpi`` (or ``auto`` where NCCL cannot serve)
gives: each cupy buffer is copied to the host, goes through the group's CPU
data plane (shm or MPI) and is copied back into the same device buffer, so
cupy values come back as cupy values on their device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from keras_dist.transports.base import Transport


class HostStagedTransport(Transport):
    """Collectives on cupy device arrays, carried out by a CPU transport."""

    stages_through_host = True

    def __init__(self, cpu: Transport) -> None:
        super().__init__()
        self.cpu = cpu
        self.name = f"host-staged {cpu.name}"

    def allreduce(self, buf, op: int, name: str | None = None, send=None) -> None:
        host = (buf if send is None else send).get()
        self.cpu.allreduce(host, op, name=name)
        buf.set(host)

    def broadcast(self, buf, root: int, name: str | None = None) -> None:
        host = buf.get()
        self.cpu.broadcast(host.view(np.uint8), root, name=name)
        buf.set(host)

    def allgatherv(self, send, recv, counts: Sequence[int], name: str | None = None) -> None:
        host = np.empty(recv.size, recv.dtype)
        self.cpu.allgatherv(send.get(), host, counts, name=name)
        recv.set(host)

    def barrier(self) -> None:
        self.cpu.barrier()

    def wait_seconds(self) -> float | None:
        return self.cpu.wait_seconds()
