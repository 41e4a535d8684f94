"""``python -m keras_dist.bench latency`` pieces without MPI: arguments, rows."""

import pytest

from keras_dist.bench import __main__ as bench_main
from keras_dist.bench import latency


def test_defaults_cover_4_bytes_to_4_kib_of_every_collective():
    args = latency.parse_args([])
    assert args.collectives == ("allreduce", "broadcast", "allgather")
    assert (args.minbytes, args.maxbytes, args.stepfactor) == (4, 4096, 4)
    assert (args.dtype, args.iters, args.warmup, args.reps, args.transport) == \
        ("float32", 2000, 200, 9, None)


def test_full_command_line():
    args = latency.parse_args(["--collectives", "broadcast,allreduce", "-b", "16", "-e", "64K",
                               "-f", "2", "--dtype", "int64", "-n", "7", "-w", "0",
                               "--reps", "3", "--transport", "mpi"])
    assert args.collectives == ("broadcast", "allreduce")
    assert (args.minbytes, args.maxbytes, args.stepfactor) == (16, 64 << 10, 2)
    assert (args.dtype, args.iters, args.warmup, args.reps, args.transport) == \
        ("int64", 7, 0, 3, "mpi")


@pytest.mark.parametrize("argv", [
    ["--collectives", "reducescatter"],
    ["--collectives", ""],
    ["-b", "1K", "-e", "4"],
    ["-f", "1"],
    ["-n", "0"],
    ["--reps", "0"],
    ["--dtype", "bfloat16"],
    ["--transport", "nccl"],
])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        latency.parse_args(argv)
    assert exited.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_rows_line_up_with_the_header():
    header = latency.header_line().lstrip("#").split()
    assert tuple(header) == latency.COLUMNS
    row = latency.format_row("allreduce", 4, 3e-6, 1.5e-6, 6e-6, 0.25e-6, 0).split()
    assert row == ["allreduce", "4", "3.00", "1.50", "6.00", "0.50", "0.25", "0.25", "0"]
    assert len(latency.header_line()) == len(latency.format_row(
        "allgather", 4096, 1e-5, None, 2e-5, None, 0))


def test_without_an_engine_its_cells_are_dashes():
    row = latency.format_row("broadcast", 64, 2e-6, None, 4e-6, None, 3).split()
    assert row == ["broadcast", "64", "2.00", "-", "4.00", "0.50", "-", "-", "3"]


def test_ratio():
    assert latency.ratio(1.0, 4.0) == 0.25
    assert latency.ratio(None, 4.0) is None
    assert latency.ratio(1.0, 0.0) is None


def test_load_average_is_three_numbers_or_unknown():
    text = latency.load_average()
    assert text == "unknown" or [float(v) >= 0 for v in text.split()] == [True] * 3


def test_entry_point_dispatches_latency(monkeypatch):
    seen = []
    monkeypatch.setattr(latency, "main", lambda argv: seen.append(argv) or 0)
    assert bench_main.main(["latency", "-n", "3"]) == 0
    assert seen == [["-n", "3"]]
