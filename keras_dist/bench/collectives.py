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
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

COLLECTIVES = ("allreduce", "broadcast", "allgather")
OPS = ("sum", "min", "max", "product")
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "int32", "int64", "uint8")
TRANSPORTS = ("shm", "mpi")

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE_PATTERN = re.compile(r"^\s*(\d+)\s*([KMG]?)(?:I?B)?\s*$", re.IGNORECASE)

#: Relative error allowed against the float64 reference, per rank, scaled by
#: the larger of sum(|x_i|) and |reference| (float16/bfloat16 are accumulated
#: in float32 and rounded once).
_TOLERANCE = {
    "float16": 2e-3,
    "bfloat16": 1.6e-2,
    "float32": 1e-6,
    "float64": 1e-13,
}
_CHECK_CHUNK_ELEMENTS = 1 << 20
_SEED = 20240


# ---------------------------------------------------------------------------
# Arguments.


def parse_size(text: str) -> int:
    """Parses a byte count: ``4``, ``1K``, ``256M``, ``1G`` (binary units; ``KB``/``KiB`` too).

    Raises:
        ValueError: when ``text`` is not such a count, or is zero.
    """
    match = _SIZE_PATTERN.match(str(text))
    if not match:
        raise ValueError(
            "A size must be a whole number of bytes with an optional K, M or G suffix "
            f"(for example 4, 1K, 256M). Received: {text!r}"
        )
    value = int(match.group(1)) * _SIZE_UNITS[match.group(2).upper()]
    if value <= 0:
        raise ValueError(f"A size must be at least 1 byte. Received: {text!r}")
    return value


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1. Received: {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0. Received: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m keras_dist.bench",
        description="nccl-tests-style benchmark of keras_dist collectives, optionally "
        "beside mpi4py in the same job. Launch on N ranks with kdrun or mpiexec. "
        "(`python -m keras_dist.bench train --help`: the training benchmark.)",
    )
    parser.add_argument("collective", choices=COLLECTIVES)
    parser.add_argument("-b", "--minbytes", type=_size_arg, default=parse_size("4"),
                        help="smallest size in bytes (4, 1K, 256M, ...); default 4")
    parser.add_argument("-e", "--maxbytes", type=_size_arg, default=parse_size("64M"),
                        help="largest size in bytes; default 64M")
    parser.add_argument("-f", "--stepfactor", type=_positive_int, default=4,
                        help="multiply the size by this from -b to -e; default 4")
    parser.add_argument("--op", choices=OPS, default="sum", help="allreduce op; default sum")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="float32")
    parser.add_argument("--transport", choices=TRANSPORTS, default=None,
                        help="sets KERAS_DIST_CPU_OPERATIONS before kd.init(); "
                        "default: leave the environment's choice")
    parser.add_argument("--vs", choices=("mpi",), default=None,
                        help="also time mpi4py on the same data in the same job")
    parser.add_argument("-n", "--iters", type=_positive_int, default=20,
                        help="calls per timed block; default 20")
    parser.add_argument("-w", "--warmup", type=_non_negative_int, default=5,
                        help="untimed calls per implementation and size; default 5")
    parser.add_argument("--reps", type=_positive_int, default=5,
                        help="timed blocks per implementation; the median is reported; "
                        "default 5")
    parser.add_argument("--root", type=_non_negative_int, default=0,
                        help="broadcast root; default 0")
    parser.add_argument("--mem-bytes", type=_size_arg, default=parse_size("256M"),
                        help="buffer each rank copies to measure memory bandwidth; default 256M")
    parser.add_argument("--inplace", action="store_true",
                        help="allreduce only: time the transport reducing a preallocated "
                             "buffer in place (the engine itself) against MPI_IN_PLACE, "
                             "instead of the out-of-place public kd.allreduce")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="draw bus bandwidth against size (needs matplotlib: "
                        "pip install 'keras-dist[plot]')")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                        help="check results against a float64 reference (default: on)")
    return parser


def check_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exits through ``parser.error`` unless -b, -e and -f make a size sweep."""
    if args.minbytes > args.maxbytes:
        parser.error(f"-b must be <= -e. Received: -b {args.minbytes} -e {args.maxbytes}")
    if args.stepfactor < 2 and args.minbytes != args.maxbytes:
        parser.error(f"-f must be >= 2 when -b < -e. Received: -f {args.stepfactor}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses the command line; exits with status 2 (argparse's) on a bad one."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_sizes(parser, args)
    if args.op != "sum" and args.collective != "allreduce":
        parser.error(f"--op applies to allreduce only. Received: {args.collective} --op {args.op}")
    if args.inplace and (args.collective != "allreduce" or args.dtype == "bfloat16"):
        parser.error("--inplace applies to allreduce of a dtype MPI has (not bfloat16). "
                     f"Received: {args.collective} --dtype {args.dtype}")
    return args


# ---------------------------------------------------------------------------
# Sizes and bandwidth.


def size_steps(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """Byte sizes ``min_bytes, min_bytes*factor, ...`` up to ``max_bytes`` inclusive."""
    if min_bytes < 1 or max_bytes < min_bytes:
        raise ValueError(
            "Sizes must satisfy 1 <= min_bytes <= max_bytes. "
            f"Received: min_bytes={min_bytes}, max_bytes={max_bytes}"
        )
    if min_bytes == max_bytes:
        return [min_bytes]
    if factor < 2:
        raise ValueError(f"`factor` must be >= 2. Received: factor={factor}")
    steps = []
    size = min_bytes
    while size <= max_bytes:
        steps.append(size)
        size *= factor
    return steps


def element_counts(collective: str, size_bytes: int, itemsize: int, nranks: int) -> int:
    """Elements a row moves: the whole buffer (allreduce, broadcast) or the
    gathered output (allgather: a whole number of elements per rank). At least
    one element per rank."""
    if collective == "allgather":
        return max(1, size_bytes // (itemsize * nranks)) * nranks
    return max(1, size_bytes // itemsize)


def bus_factor(collective: str, nranks: int) -> float:
    """nccl-tests' busbw/algbw: 2(n-1)/n allreduce, (n-1)/n allgather, 1 broadcast."""
    if nranks < 1:
        raise ValueError(f"`nranks` must be >= 1. Received: nranks={nranks}")
    if collective == "allreduce":
        return 2.0 * (nranks - 1) / nranks
    if collective == "allgather":
        return (nranks - 1) / nranks
    if collective == "broadcast":
        return 1.0
    raise ValueError(f"`collective` must be one of {COLLECTIVES}. Received: {collective!r}")


def bandwidths(collective: str, size_bytes: int, seconds: float,
               nranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes per second) for ``size_bytes`` in ``seconds``."""
    algbw = size_bytes / seconds / 1e9 if seconds > 0 else 0.0
    return algbw, algbw * bus_factor(collective, nranks)


# ---------------------------------------------------------------------------
# Data and checking.


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a ``--dtype`` name (bfloat16 from ml_dtypes)."""
    if name == "bfloat16":
        from keras_dist import _vocab

        return _vocab.bfloat16_dtype()
    if name not in DTYPE_NAMES:
        raise ValueError(f"`dtype` must be one of {DTYPE_NAMES}. Received: {name!r}")
    return np.dtype(name)


def make_input(count: int, dtype_name: str, op: str, rank: int, nranks: int,
               salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s random input: the same on every rank that asks for it."""
    rng = np.random.default_rng([_SEED, salt, count, rank])
    dtype = numpy_dtype(dtype_name)
    if op == "product":
        if dtype.kind in "iu":
            return rng.integers(1, 4, count, dtype=np.int64).astype(dtype)
        return rng.uniform(0.5, 1.5, count).astype(dtype)
    if dtype.kind == "u":
        return rng.integers(1, max(2, 256 // nranks), count, dtype=np.int64).astype(dtype)
    if dtype.kind == "i":
        return rng.integers(-1000, 1000, count, dtype=np.int64).astype(dtype)
    if dtype in (np.float32, np.float64):
        return rng.standard_normal(count, dtype=dtype)
    return rng.standard_normal(count, dtype=np.float32).astype(dtype)


def _reduce_reference(op: str, chunks: list[np.ndarray], wide: type) -> np.ndarray:
    result = chunks[0].astype(wide)
    combine = {"sum": np.add, "min": np.minimum, "max": np.maximum,
               "product": np.multiply}[op]
    for chunk in chunks[1:]:
        combine(result, chunk.astype(wide), out=result)
    return result


def count_wrong_allreduce(result: np.ndarray, inputs: Sequence[np.ndarray], op: str) -> int:
    """Elements of ``result`` that differ from the reduction of ``inputs``.

    Integers must match the int64 reduction wrapped to their dtype; floats must
    lie within the dtype's tolerance (times the rank count) of the float64
    reduction, relative to max(sum(|x_i|), |reference|).
    """
    dtype = inputs[0].dtype
    result = np.asarray(result).reshape(-1)
    if result.dtype != dtype or result.size != inputs[0].size:
        return inputs[0].size
    wrong = 0
    integer = dtype.kind in "iu"
    tolerance = 0.0 if integer else _TOLERANCE[dtype.name] * len(inputs)
    for start in range(0, result.size, _CHECK_CHUNK_ELEMENTS):
        stop = start + _CHECK_CHUNK_ELEMENTS
        chunks = [a[start:stop] for a in inputs]
        if integer:
            expected = _reduce_reference(op, chunks, np.int64).astype(dtype)
            wrong += int(np.count_nonzero(result[start:stop] != expected))
            continue
        reference = _reduce_reference(op, chunks, np.float64)
        scale = np.abs(chunks[0].astype(np.float64))
        for chunk in chunks[1:]:
            scale += np.abs(chunk.astype(np.float64))
        np.maximum(scale, np.abs(reference), out=scale)
        error = np.abs(result[start:stop].astype(np.float64) - reference)
        wrong += int(np.count_nonzero(~(error <= tolerance * scale)))
    return wrong


def count_wrong_exact(result: np.ndarray, expected: np.ndarray) -> int:
    """Elements of ``result`` whose bytes differ from ``expected`` (broadcast, allgather)."""
    result = np.asarray(result).reshape(-1)
    expected = expected.reshape(-1)
    if result.dtype != expected.dtype or result.size != expected.size:
        return expected.size
    width = expected.dtype.itemsize
    view = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    return int(np.count_nonzero(result.view(view) != expected.view(view)))


# ---------------------------------------------------------------------------
# Output.

_GROUP_COLUMNS = ("time(us)", "algbw", "busbw", "#wrong", "%mem")
_GROUP_UNITS = ("(us)", "(GB/s)", "(GB/s)", "", "")
_GROUP_WIDTHS = (11, 8, 8, 7, 6)
_ROW_COLUMNS = ("size", "count", "type", "redop")
_ROW_UNITS = ("(B)", "(elements)", "", "")
_ROW_WIDTHS = (12, 12, 9, 8)
_RATIO_COLUMNS = ("time", "busbw")
_RATIO_WIDTHS = (7, 7)


def _cells(values: Sequence[str], widths: Sequence[int]) -> str:
    """Right-aligned cells, each led by at least one space even when it overflows."""
    return "".join(f" {v:>{w - 1}}" for v, w in zip(values, widths))


def header_lines(kd_label: str, mpi_label: str | None) -> list[str]:
    """The three header lines: group titles, column names, units."""
    row_width = sum(_ROW_WIDTHS)
    group_width = sum(_GROUP_WIDTHS)
    titles = " " * (row_width - 1) + f"{kd_label:>{group_width}}"
    names = _cells(_ROW_COLUMNS, _ROW_WIDTHS)[1:] + _cells(_GROUP_COLUMNS, _GROUP_WIDTHS)
    units = _cells(_ROW_UNITS, _ROW_WIDTHS)[1:] + _cells(_GROUP_UNITS, _GROUP_WIDTHS)
    if mpi_label is not None:
        titles += f"{mpi_label:>{group_width}}" + f"{'kd/mpi':>{sum(_RATIO_WIDTHS)}}"
        names += _cells(_GROUP_COLUMNS, _GROUP_WIDTHS) + _cells(_RATIO_COLUMNS, _RATIO_WIDTHS)
        units += _cells(_GROUP_UNITS, _GROUP_WIDTHS) + _cells(("", ""), _RATIO_WIDTHS)
    return ["#" + titles, "#" + names, "#" + units]


def _group_cells(seconds: float, algbw: float, busbw: float, wrong: int | None,
                 mem_gbps: float) -> list[str]:
    percent = f"{100 * busbw / mem_gbps:.1f}" if mem_gbps > 0 else "n/a"
    return [f"{seconds * 1e6:.2f}", f"{algbw:.3f}", f"{busbw:.3f}",
            "N/A" if wrong is None else str(wrong), percent]


def format_row(size_bytes: int, count: int, dtype_name: str, redop: str,
               kd: tuple[float, float, float, int | None], mem_gbps: float,
               mpi: tuple[float, float, float, int | None] | None = None) -> str:
    """One table row; ``kd``/``mpi`` are (seconds, algbw, busbw, wrong or None)."""
    line = _cells([str(size_bytes), str(count), dtype_name, redop], _ROW_WIDTHS)
    line += _cells(_group_cells(*kd, mem_gbps), _GROUP_WIDTHS)
    if mpi is not None:
        line += _cells(_group_cells(*mpi, mem_gbps), _GROUP_WIDTHS)
        time_ratio = f"{kd[0] / mpi[0]:.2f}" if mpi[0] > 0 else "n/a"
        bus_ratio = f"{kd[2] / mpi[2]:.2f}" if mpi[2] > 0 else "n/a"
        line += _cells([time_ratio, bus_ratio], _RATIO_WIDTHS)
    return line


# ---------------------------------------------------------------------------
# Measurement (needs MPI).


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


class _Case:
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

            transport = kd._get().transport
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


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark on every rank of the job; rank 0 prints. Returns the exit status."""
    kd, comm = init_job(args.transport)
    from mpi4py import MPI

    rank, nranks = comm.Get_rank(), comm.Get_size()
    if args.collective == "broadcast" and args.root >= nranks:
        raise ValueError(f"`--root` must be in [0, size). Received: root={args.root} "
                         f"(size={nranks})")
    transport = kd._get().transport.name
    single_copy = getattr(kd._get().transport, "single_copy_status", None)
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
        case = _Case(args, comm, count)
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
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
