"""Collective benchmark in the shape of nccl-tests, keras_dist beside mpi4py.

    kdrun -np 2 python -m keras_dist.bench allreduce -b 4 -e 64M -f 4 --vs mpi
    mpiexec -n 2 python -m keras_dist.bench allgather -b 1K -e 16M --transport mpi

For each size from ``-b`` to ``-e`` (multiplying by ``-f``) rank 0 prints
nccl-tests' columns ``size count type redop time algbw busbw #wrong`` for the
out-of-place public call (``kd.allreduce(x, op=...)`` returns a new array;
with ``--inplace``, the transport reducing a preallocated buffer in place
against ``MPI_IN_PLACE``),
plus ``%mem``: the row's bus bandwidth as a percentage of the memory-copy
bandwidth two processes get when both copy at once, measured in the same run.
With ``--vs mpi`` the same columns follow for mpi4py on the same data in the
same job (``Allreduce``/``Bcast``/``Allgather`` on a duplicate of
``COMM_WORLD``, preallocated receive buffers), then the ratios
keras_dist/mpi4py of time and of bus bandwidth.

Timing: ``-w`` untimed calls per implementation, then ``--reps`` timed blocks
of ``-n`` calls each, alternating keras_dist and mpi4py blocks (ABAB...) so
that drift hits both; every block starts after a barrier. A block's time per
call is taken as the slowest rank's (MAX over ranks); the row shows the
median over the blocks. GB/s are 1e9 bytes per second, as in nccl-tests:
``algbw = size / time``; ``busbw = algbw * 2(n-1)/n`` (allreduce),
``(n-1)/n`` (allgather), ``1`` (broadcast). For allgather, ``size`` and
``count`` are those of the gathered output, as in nccl-tests.

Checking: after timing, one more call per implementation is compared with a
float64 (integers: int64, wrapping like the kernels) reference that every rank
computes itself, regenerating every rank's random input from its seed.
``#wrong`` counts the elements outside the dtype's tolerance, summed over
ranks. The exit status is 1 when any ``#wrong`` is non-zero.

The command line is ``arguments``, the sizes and bandwidths ``sizes``, the
inputs and the check ``checks``, the timing ``measure``, the rows ``table``;
``run`` here ties them together.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np

from keras_dist._runtime import context
from keras_dist.bench.collectives.arguments import parse_args
from keras_dist.bench.collectives.checks import numpy_dtype
from keras_dist.bench.collectives.measure import Case, init_job, measure_memcpy, time_alternating
from keras_dist.bench.collectives.sizes import bandwidths, element_counts, size_steps
from keras_dist.bench.collectives.table import format_row, header_lines


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark on every rank of the job; rank 0 prints. Returns the exit status."""
    kd, comm = init_job(args.transport)
    from mpi4py import MPI

    rank, nranks = comm.Get_rank(), comm.Get_size()
    if args.collective == "broadcast" and args.root >= nranks:
        raise ValueError(f"`--root` must be in [0, size). Received: root={args.root} "
                         f"(size={nranks})")
    transport = context.get().transport.name
    single_copy = context.get().transport.single_copy_status
    vs_mpi = args.vs == "mpi"

    def say(line: str = "") -> None:
        if rank == 0:
            print(line, flush=True)

    mem_gbps = measure_memcpy(comm, args.mem_bytes)
    itemsize = numpy_dtype(args.dtype).itemsize
    redop = args.op if args.collective == "allreduce" else "none"
    mpi_name = {"allreduce": "Allreduce", "broadcast": "Bcast", "allgather": "Allgather"}
    say(f"# keras_dist.bench {args.collective}: nranks {nranks}, transport {transport}, "
        f"dtype {args.dtype}, op {redop}"
        + (f", root {args.root}" if args.collective == "broadcast" else ""))
    if single_copy is not None:
        say(f"# shm single-copy reads (process_vm_readv): {single_copy}")
    say(f"# timing: median of {args.reps} blocks of {args.iters} calls (after {args.warmup} "
        "warm-up calls), slowest rank per block"
        + (", keras_dist and mpi4py blocks alternating" if vs_mpi else ""))
    say(f"# memory copy: {mem_gbps:.2f} GB/s per process (each of {nranks} ranks np.copyto "
        f"{args.mem_bytes / (1 << 20):g} MiB at once, median of 5); %mem = busbw / that")
    if vs_mpi:
        note = " (bfloat16 travels as float32: no MPI datatype)" if (
            args.dtype == "bfloat16" and args.collective == "allreduce") else ""
        say(f"# mpi4py: comm.{mpi_name[args.collective]} on a duplicate of COMM_WORLD, "
            f"preallocated receive buffer{note}")
    say("#")
    for line in header_lines(f"keras_dist ({transport})", "mpi4py" if vs_mpi else None):
        say(line)

    kd_busbw, mpi_busbw, plotted_sizes = [], [], []
    total_wrong = 0
    seen_counts = set()
    for size_bytes in size_steps(args.minbytes, args.maxbytes, args.stepfactor):
        count = element_counts(args.collective, size_bytes, itemsize, nranks)
        if count in seen_counts:
            continue
        seen_counts.add(count)
        case = Case(args, comm, count)
        calls = [case.kd_call, case.mpi_call] if vs_mpi else [case.kd_call]
        seconds = time_alternating(calls, comm, args.iters, args.reps, args.warmup)
        wrong: list[int | None] = [None] * len(calls)
        if args.check:
            local = np.array([case.check_kd()]
                             + ([case.check_mpi()] if vs_mpi else []), np.int64)
            comm.Allreduce(MPI.IN_PLACE, local, op=MPI.SUM)
            wrong = [int(w) for w in local]
            total_wrong += sum(wrong)
        nbytes = count * itemsize
        rows = []
        for t, w in zip(seconds, wrong):
            algbw, busbw = bandwidths(args.collective, nbytes, t, nranks)
            rows.append((t, algbw, busbw, w))
        kd_busbw.append(rows[0][2])
        plotted_sizes.append(nbytes)
        if vs_mpi:
            mpi_busbw.append(rows[1][2])
        say(format_row(nbytes, count, args.dtype, redop, rows[0], mem_gbps,
                       rows[1] if vs_mpi else None))
        del case, calls

    say(f"# Out of bounds values : {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}"
        if args.check else "# Results not checked (--no-check)")
    say(f"# Avg bus bandwidth    : {np.mean(kd_busbw):.3f} GB/s  keras_dist ({transport})")
    if vs_mpi:
        say(f"# Avg bus bandwidth    : {np.mean(mpi_busbw):.3f} GB/s  mpi4py")
    if args.plot and rank == 0:
        from keras_dist.bench import plot

        series = {f"keras_dist ({transport})": kd_busbw}
        if vs_mpi:
            series["mpi4py"] = mpi_busbw
        plot.bandwidth_lines(args.plot, plotted_sizes, series,
                             f"{args.collective}, {args.dtype}, {nranks} ranks")
        say(f"# plot written to {args.plot}")
    comm.Free()
    return 1 if total_wrong else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m keras_dist.bench`` dispatches here (``bench/__main__.py``)."""
    return run(parse_args(argv))
