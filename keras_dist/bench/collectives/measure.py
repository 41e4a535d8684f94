"""The timing (alternating blocks after a barrier, the slowest rank's time) and
the cases it times; needs MPI."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence

import numpy as np

from keras_dist._runtime import context
from keras_dist.bench.collectives.checks import (
    count_wrong_allreduce,
    count_wrong_exact,
    make_input,
    numpy_dtype,
)


def measure_memcpy(comm, nbytes: int, reps: int = 5) -> float:
    """GB/s each process copies at when every rank ``np.copyto``s ``nbytes`` at once.

    The slowest rank's time of each copy counts; the median over ``reps``.
    """
    from mpi4py import MPI

    source = np.full(nbytes, 0x5A, np.uint8)
    target = np.empty_like(source)
    np.copyto(target, source)  # fault the pages in before timing
    times = np.empty(reps)
    for i in range(reps):
        comm.Barrier()
        start = time.perf_counter()
        np.copyto(target, source)
        times[i] = time.perf_counter() - start
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return nbytes / float(np.median(times)) / 1e9


def time_alternating(calls: Sequence[Callable[[], object]], comm, iters: int, reps: int,
                     warmup: int) -> list[float]:
    """Median seconds per call of each of ``calls``, timed in alternating blocks.

    Each call gets ``warmup`` untimed runs, then ``reps`` rounds of one
    barrier-started block of ``iters`` runs per call, in order (ABAB...). A
    block's time is the slowest rank's.
    """
    from mpi4py import MPI

    for call in calls:
        for _ in range(warmup):
            call()
    times = np.empty((len(calls), reps))
    for rep in range(reps):
        for index, call in enumerate(calls):
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(iters):
                call()
            times[index, rep] = (time.perf_counter() - start) / iters
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return [float(t) for t in np.median(times, axis=1)]


class Case:
    """One size of one collective: inputs, the two implementations, the check."""

    def __init__(self, args: argparse.Namespace, comm, count: int) -> None:
        from mpi4py import MPI

        import keras_dist as kd

        self.rank, self.nranks = comm.Get_rank(), comm.Get_size()
        self.args, self.comm, self.count = args, comm, count
        self.dtype = numpy_dtype(args.dtype)
        collective = args.collective
        local_count = count // self.nranks if collective == "allgather" else count
        self.local_count = local_count
        self.input = make_input(local_count, args.dtype, args.op, self.rank, self.nranks)
        mpi_op = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "product": MPI.PROD}[args.op]
        kd_op = {"sum": kd.Sum, "min": kd.Min, "max": kd.Max, "product": kd.Product}[args.op]
        x = self.input
        if collective == "allreduce" and args.inplace:
            # Both sides reduce a preallocated buffer in place: the transport
            # (the native engine, or keras_dist's MPI transport) against MPI itself.
            from keras_dist import _vocab

            transport = context.get().transport
            code = _vocab.TRANSPORT_OPS[kd_op]
            self.kd_buf, self.mpi_recv = x.copy(), x.copy()

            def kd_call():
                transport.allreduce(self.kd_buf, code)
                return self.kd_buf

            def mpi_call():
                comm.Allreduce(MPI.IN_PLACE, self.mpi_recv, op=mpi_op)
                return self.mpi_recv

            self.kd_call, self.mpi_call = kd_call, mpi_call
            return
        if collective == "allreduce":
            self.kd_call = lambda: kd.allreduce(x, op=kd_op)
            if args.dtype == "bfloat16":  # no MPI datatype: travel as float32
                wide_recv = np.empty(local_count, np.float32)
                self.mpi_recv = np.empty_like(x)

                def mpi_call():
                    comm.Allreduce(x.astype(np.float32), wide_recv, op=mpi_op)
                    self.mpi_recv[...] = wide_recv.astype(self.dtype)
                    return self.mpi_recv
            else:
                self.mpi_recv = np.empty_like(x)

                def mpi_call():
                    comm.Allreduce(x, self.mpi_recv, op=mpi_op)
                    return self.mpi_recv
        elif collective == "broadcast":
            root = args.root
            self.kd_call = lambda: kd.broadcast(x, root_rank=root)
            self.mpi_recv = x.copy()

            def mpi_call():
                comm.Bcast(self.mpi_recv.view(np.uint8), root=root)
                return self.mpi_recv
        else:
            self.kd_call = lambda: kd.allgather(x)
            self.mpi_recv = np.empty(count, self.dtype)
            send_bytes, recv_bytes = x.view(np.uint8), self.mpi_recv.view(np.uint8)

            def mpi_call():
                comm.Allgather(send_bytes, recv_bytes)
                return self.mpi_recv
        self.mpi_call = mpi_call

    def wrong(self, result: np.ndarray) -> int:
        """This rank's #wrong for ``result``."""
        args = self.args
        if args.collective == "allreduce":
            inputs = [self.input if r == self.rank else
                      make_input(self.local_count, args.dtype, args.op, r, self.nranks)
                      for r in range(self.nranks)]
            return count_wrong_allreduce(result, inputs, args.op)
        if args.collective == "broadcast":
            expected = self.input if self.rank == args.root else make_input(
                self.local_count, args.dtype, args.op, args.root, self.nranks)
            return count_wrong_exact(result, expected)
        expected = np.concatenate([
            self.input if r == self.rank else
            make_input(self.local_count, args.dtype, args.op, r, self.nranks)
            for r in range(self.nranks)])
        return count_wrong_exact(result, expected)

    def check_kd(self) -> int:
        """One fresh keras_dist call, checked (in place: from the input again)."""
        if self.args.inplace:
            self.kd_buf[...] = self.input
        return self.wrong(self.kd_call())

    def check_mpi(self) -> int:
        """One fresh mpi4py call into a receive buffer filled with garbage, checked."""
        if self.args.inplace:
            self.mpi_recv[...] = self.input
            return self.wrong(self.mpi_call())
        self.mpi_recv.view(np.uint8)[...] = 0xA5
        if self.args.collective == "broadcast" and self.rank == self.args.root:
            self.mpi_recv[...] = self.input
        return self.wrong(self.mpi_call())


def init_job(transport: str | None):
    """Sets ``--transport`` (when given) and initialises keras_dist; returns
    ``(keras_dist, comm)``, ``comm`` a duplicate of MPI's world for the mpi4py runs."""
    if transport is not None:
        os.environ["KERAS_DIST_CPU_OPERATIONS"] = transport
    from mpi4py import MPI

    import keras_dist as kd

    kd.init()
    return kd, MPI.COMM_WORLD.Dup()
