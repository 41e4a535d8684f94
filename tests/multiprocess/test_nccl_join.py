"""``join`` while NCCL reduces GPU values: refused on every rank, none left waiting.

NCCL cannot reduce without every rank, so the rank that calls ``join`` tells
the others over MPI and raises; each other rank finds the notice while it
waits (or at its next launch), aborts its communicator and raises with the
same reason. No GPU here: the NCCL transport runs its real MPI signalling
around a stand-in communicator and streams (those of
tests/unit/test_device_queue.py), whose collective never finishes, as a
peer's would not when one rank has left for ``join``.
"""

import sys

from tests._mp import run_job

WORKER = r"""
import sys
sys.path.insert(0, ".")
from mpi4py import MPI

import keras_dist as kd
from keras_dist._runtime import context
from keras_dist._runtime.liveness import Waiter
from keras_dist.errors import TransportError
from keras_dist.transports.device_queue import DeviceQueue
from keras_dist.transports.nccl import NcclTransport
from tests.unit.test_device_queue import FakeComm, FakeNcclError, FakeStream

kd.init()
group = context.get()
log = []
nccl = NcclTransport.__new__(NcclTransport)  # its MPI side, around stand-ins for NCCL
nccl.rank, nccl._rank_names = group.rank, list(group.ranks)
nccl._notices, nccl._sent, nccl._join_reason = group.comm.Dup(), [], None
fake_comm = FakeComm(log)
nccl.comm = fake_comm
nccl.queue = DeviceQueue(FakeStream("side", log, ptr=1, polls_until_done=None),
                         lambda: FakeStream("caller", log, ptr=2), fake_comm,
                         Waiter([], group.rank, 0, 120.0, "nccl"), FakeNcclError, group.rank,
                         interrupted=nccl._peer_joined)
group.gpu_transport = nccl
try:
    if group.rank == 1:
        kd.join()
    else:
        nccl.queue.launch(lambda stream: None, "allreduce of grads")
        nccl.complete("allreduce of grads")  # never finishes: rank 1 is not in it
except TransportError as error:
    print(f"RAISED rank={group.rank}: {error}", flush=True)
    print(f"ABORTED rank={group.rank} {fake_comm.aborts}", flush=True)
group.gpu_transport = None
nccl._notices.Free()
"""


def test_join_with_nccl_raises_on_every_rank_saying_why():
    result = run_job([sys.executable, "-c", WORKER], np=2, timeout=120).check()
    joined = result.output(1)
    assert "RAISED rank=1: join() cannot run on rank 1: rank 1 called join(), and NCCL " \
           "cannot reduce GPU values without every rank" in joined, result.describe()
    waiting = result.output(0)
    assert "RAISED rank=0: allreduce of grads cannot run on rank 0: rank 1 called join()" \
        in waiting, result.describe()
    assert "KERAS_DIST_GPU_OPERATIONS=mpi" in waiting, result.describe()
    for rank in (0, 1):  # each rank's communicator aborted, so nothing waits in NCCL
        assert f"ABORTED rank={rank} 1" in result.output(rank), result.describe()
