"""The benchmark's command line: its choices, sizes and options."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

COLLECTIVES = ("allreduce", "broadcast", "allgather")
OPS = ("sum", "min", "max", "product")
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "int32", "int64", "uint8")
TRANSPORTS = ("shm", "mpi")

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE_PATTERN = re.compile(r"^\s*(\d+)\s*([KMG]?)(?:I?B)?\s*$", re.IGNORECASE)


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


def size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1. Received: {text!r}")
    return value


def non_negative_int(text: str) -> int:
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
    parser.add_argument("-b", "--minbytes", type=size_arg, default=parse_size("4"),
                        help="smallest size in bytes (4, 1K, 256M, ...); default 4")
    parser.add_argument("-e", "--maxbytes", type=size_arg, default=parse_size("64M"),
                        help="largest size in bytes; default 64M")
    parser.add_argument("-f", "--stepfactor", type=positive_int, default=4,
                        help="multiply the size by this from -b to -e; default 4")
    parser.add_argument("--op", choices=OPS, default="sum", help="allreduce op; default sum")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="float32")
    parser.add_argument("--transport", choices=TRANSPORTS, default=None,
                        help="sets KERAS_DIST_CPU_OPERATIONS before kd.init(); "
                        "default: leave the environment's choice")
    parser.add_argument("--vs", choices=("mpi",), default=None,
                        help="also time mpi4py on the same data in the same job")
    parser.add_argument("-n", "--iters", type=positive_int, default=20,
                        help="calls per timed block; default 20")
    parser.add_argument("-w", "--warmup", type=non_negative_int, default=5,
                        help="untimed calls per implementation and size; default 5")
    parser.add_argument("--reps", type=positive_int, default=5,
                        help="timed blocks per implementation; the median is reported; "
                        "default 5")
    parser.add_argument("--root", type=non_negative_int, default=0,
                        help="broadcast root; default 0")
    parser.add_argument("--mem-bytes", type=size_arg, default=parse_size("256M"),
                        help="buffer each rank copies to measure memory bandwidth; default 256M")
    parser.add_argument("--inplace", action="store_true",
                        help="allreduce only: time the transport reducing a preallocated "
                             "buffer in place (the engine itself) against MPI_IN_PLACE, "
                             "instead of the out-of-place public kd.allreduce")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="draw bus bandwidth against size (needs matplotlib: "
                        "pip install matplotlib)")
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
