"""Latency of the public calls on small arrays, keras_dist beside mpi4py.

    kdrun -np 2 python -m keras_dist.bench latency                 # 4 B .. 4 KiB
    kdrun -np 2 python -m keras_dist.bench latency -b 4 -e 64K -n 5000 --reps 15

For each collective (``--collectives``, default allreduce, broadcast,
allgather) and each size from ``-b`` to ``-e`` (times ``-f``), rank 0 prints
the time per call of:

- ``keras_dist``: the public call, ``kd.allreduce(x, op=kd.Sum)``,
  ``kd.broadcast(x, root_rank=0)``, ``kd.allgather(x)``, each returning a new
  array, with every argument check and the ranks' mismatch check;
- ``engine``: on the shm transport, the engine's one-call entry alone
  (``ShmTransport.engine.allreduce_array`` etc.: the same exchange, without the
  public call's Python);
- ``mpi4py``: ``comm.Allreduce(x, recv)``, ``comm.Bcast(buf)``,
  ``comm.Allgather(x, recv)`` on preallocated buffers of a duplicate of
  ``COMM_WORLD``;

then the ratios keras_dist/mpi4py and engine/mpi4py, ``wait``: the time the
shm engine spent waiting for the peer per keras_dist call (its wait counter,
mean over one more block of ``-n`` calls, the slowest rank), and ``#wrong``.

Timing (``measure.time_alternating``): ``-w`` untimed calls each, then
``--reps`` rounds of one barrier-started block of ``-n`` calls per
implementation, implementations alternating within a round so that drift
hits all of them; a block's time per call is the slowest rank's; the table
shows the median over the rounds. The load average (``/proc/loadavg``) is
printed before and after: numbers from a busy machine say little about
latency.

Checking: one more call of each implementation is compared with the float64
reference (``collectives.checks.count_wrong_*``); the exit status is 1 when any
``#wrong`` is non-zero.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np

from keras_dist._runtime import context
from keras_dist.bench.collectives import arguments, measure, sizes, table

COLUMNS = ("collective", "bytes", "keras_dist", "engine", "mpi4py", "kd/mpi", "engine/mpi",
           "wait", "#wrong")
_WIDTHS = (11, 6, 11, 8, 8, 7, 11, 7, 7)


def _collective_list(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in arguments.COLLECTIVES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"must be a comma-separated list of {', '.join(arguments.COLLECTIVES)}. "
            f"Received: {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m keras_dist.bench latency",
        description="Time per call of kd.allreduce / kd.broadcast / kd.allgather on small "
        "numpy arrays beside mpi4py on preallocated buffers, in alternating blocks. "
        "Launch on N ranks with kdrun.")
    parser.add_argument("--collectives", type=_collective_list,
                        default=arguments.COLLECTIVES,
                        help="comma-separated; default allreduce,broadcast,allgather")
    parser.add_argument("-b", "--minbytes", type=arguments.size_arg, default=4,
                        help="smallest size in bytes; default 4")
    parser.add_argument("-e", "--maxbytes", type=arguments.size_arg, default=4 << 10,
                        help="largest size in bytes; default 4K")
    parser.add_argument("-f", "--stepfactor", type=arguments.positive_int, default=4,
                        help="multiply the size by this from -b to -e; default 4")
    parser.add_argument("--dtype", choices=("float32", "float64", "int32", "int64"),
                        default="float32")
    parser.add_argument("-n", "--iters", type=arguments.positive_int, default=2000,
                        help="calls per timed block; default 2000")
    parser.add_argument("-w", "--warmup", type=arguments.non_negative_int, default=200,
                        help="untimed calls per implementation and size; default 200")
    parser.add_argument("--reps", type=arguments.positive_int, default=9,
                        help="timed blocks per implementation (the median is shown); "
                        "default 9")
    parser.add_argument("--transport", choices=arguments.TRANSPORTS, default=None,
                        help="sets KERAS_DIST_CPU_OPERATIONS before kd.init(); default: "
                        "the environment's choice")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    arguments.check_sizes(parser, args)
    return args


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as ``/proc/loadavg`` gives them."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def ratio(numerator: float | None, denominator: float) -> float | None:
    return None if numerator is None or denominator <= 0 else numerator / denominator


def format_row(collective: str, nbytes: int, kd_seconds: float, engine_seconds: float | None,
               mpi_seconds: float, wait_seconds: float | None, wrong: int) -> str:
    """One table row: times in microseconds, ratios to mpi4py, the wait per call."""
    def us(seconds):
        return "-" if seconds is None else f"{seconds * 1e6:.2f}"

    def times(value):
        return "-" if value is None else f"{value:.2f}"

    cells = (collective, str(nbytes), us(kd_seconds), us(engine_seconds), us(mpi_seconds),
             times(ratio(kd_seconds, mpi_seconds)), times(ratio(engine_seconds, mpi_seconds)),
             us(wait_seconds), str(wrong))
    return table.cells(cells, _WIDTHS)


def header_line() -> str:
    return "#" + table.cells(COLUMNS, _WIDTHS)[1:]


def _engine_call(collective: str, transport, x: np.ndarray):
    """The shm engine's one-call entry for ``collective`` of ``x``, or None."""
    engine = transport.native_engine()
    if engine is None:
        return None
    if collective == "allreduce":
        return lambda: engine.allreduce_array(x, 1, None)  # 1: Sum
    if collective == "broadcast":
        return lambda: engine.broadcast_array(x, 0, None)
    return lambda: engine.allgather_array(x, None)


def run(args: argparse.Namespace) -> int:
    """Runs on every rank of the job; rank 0 prints. Returns the exit status."""
    kd, comm = measure.init_job(args.transport)
    from mpi4py import MPI

    rank, nranks = comm.Get_rank(), comm.Get_size()
    transport = context.get().transport
    itemsize = np.dtype(args.dtype).itemsize

    def say(line: str = "") -> None:
        if rank == 0:
            print(line, flush=True)

    say(f"# keras_dist.bench latency: {nranks} ranks, transport {transport.name}, "
        f"dtype {args.dtype}, allreduce op sum, broadcast root 0")
    say(f"# load average before: {load_average()}")
    say(f"# timing: median of {args.reps} blocks of {args.iters} calls (after {args.warmup} "
        "warm-up calls), slowest rank per block, implementations alternating")
    say("# keras_dist: the public call (new array out); engine: the shm engine's one-call "
        "entry alone; mpi4py: Allreduce/Bcast/Allgather on preallocated buffers")
    say("# times in us; wait: the engine's wait for the peer per keras_dist call (mean of one "
        "more block, slowest rank)")
    say(header_line())
    total_wrong = 0
    for collective in args.collectives:
        seen = set()
        for size_bytes in sizes.size_steps(args.minbytes, args.maxbytes, args.stepfactor):
            count = sizes.element_counts(collective, size_bytes, itemsize, nranks)
            if count in seen:
                continue
            seen.add(count)
            case = measure.Case(argparse.Namespace(
                collective=collective, dtype=args.dtype, op="sum", root=0, inplace=False),
                comm, count)
            engine = _engine_call(collective, transport, case.input)
            calls = [case.kd_call, case.mpi_call] + ([engine] if engine else [])
            seconds = measure.time_alternating(calls, comm, args.iters, args.reps,
                                                   args.warmup)
            wait = None
            if transport.wait_seconds() is not None:  # one more block, untimed
                comm.Barrier()
                before = transport.wait_seconds()
                for _ in range(args.iters):
                    case.kd_call()
                wait = comm.allreduce((transport.wait_seconds() - before) / args.iters,
                                      op=MPI.MAX)
            local = case.check_kd() + case.check_mpi()
            if engine is not None:
                local += case.wrong(engine())
            wrong = comm.allreduce(local, op=MPI.SUM)
            total_wrong += wrong
            nbytes = count * itemsize
            say(format_row(collective, nbytes, seconds[0], seconds[2] if engine else None,
                           seconds[1], wait, wrong))
    say(f"# load average after: {load_average()}")
    say(f"# Out of bounds values : {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}")
    comm.Free()
    return 1 if total_wrong else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m keras_dist.bench`` dispatches here (``bench/__main__.py``)."""
    return run(parse_args(argv))
