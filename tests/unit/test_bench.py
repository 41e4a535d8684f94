"""``keras_dist.bench`` without MPI: arguments, sizes, bandwidth formulas, checking, rows."""

import numpy as np
import pytest

from keras_dist.bench import collectives
from keras_dist.bench.collectives import arguments, checks, measure, sizes, table


@pytest.mark.parametrize("text, expected", [
    ("4", 4), ("1K", 1024), ("1k", 1024), ("256M", 256 << 20), ("1G", 1 << 30),
    ("64KB", 64 << 10), ("2MiB", 2 << 20), (" 8 ", 8), ("3000", 3000),
])
def test_parse_size(text, expected):
    assert arguments.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "0", "-4", "1.5M", "4T", "M", "12 34", "1KK"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="Received"):
        arguments.parse_size(text)


def test_defaults():
    args = arguments.parse_args(["allreduce"])
    assert (args.collective, args.minbytes, args.maxbytes, args.stepfactor) == \
        ("allreduce", 4, 64 << 20, 4)
    assert (args.op, args.dtype, args.transport, args.vs) == ("sum", "float32", None, None)
    assert (args.iters, args.warmup, args.reps, args.check) == (20, 5, 5, True)


def test_full_command_line():
    args = arguments.parse_args([
        "allgather", "-b", "1K", "-e", "256M", "-f", "2", "--dtype", "bfloat16",
        "--transport", "shm", "--vs", "mpi", "-n", "7", "-w", "0", "--reps", "3",
        "--no-check", "--mem-bytes", "16M",
    ])
    assert (args.minbytes, args.maxbytes, args.stepfactor) == (1024, 256 << 20, 2)
    assert (args.dtype, args.transport, args.vs) == ("bfloat16", "shm", "mpi")
    assert (args.iters, args.warmup, args.reps, args.check, args.mem_bytes) == \
        (7, 0, 3, False, 16 << 20)


@pytest.mark.parametrize("op", arguments.OPS)
def test_every_op(op):
    assert arguments.parse_args(["allreduce", "--op", op]).op == op


@pytest.mark.parametrize("argv", [
    ["reduce_scatter"],
    ["allreduce", "-b", "1X"],
    ["allreduce", "-b", "1M", "-e", "1K"],
    ["allreduce", "-f", "1"],
    ["allreduce", "--op", "average"],
    ["allreduce", "--dtype", "complex64"],
    ["allreduce", "--transport", "nccl"],
    ["allreduce", "--vs", "gloo"],
    ["allreduce", "-n", "0"],
    ["allreduce", "-w", "-1"],
    ["broadcast", "--op", "max"],
    ["broadcast", "--inplace"],
    ["allreduce", "--inplace", "--dtype", "bfloat16"],
])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        arguments.parse_args(argv)
    assert exited.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_size_steps():
    assert sizes.size_steps(4, 256 << 20, 4)[:3] == [4, 16, 64]
    assert sizes.size_steps(4, 256 << 20, 4)[-1] == 256 << 20
    assert len(sizes.size_steps(4, 256 << 20, 4)) == 14  # 2**2 .. 2**28
    assert sizes.size_steps(1024, 5000, 2) == [1024, 2048, 4096]
    assert sizes.size_steps(8, 8, 1) == [8]
    with pytest.raises(ValueError, match="factor"):
        sizes.size_steps(4, 64, 1)


def test_element_counts():
    assert sizes.element_counts("allreduce", 4, 4, 2) == 1
    assert sizes.element_counts("allreduce", 4, 8, 2) == 1  # at least one element
    assert sizes.element_counts("allreduce", 1 << 20, 4, 3) == 1 << 18
    assert sizes.element_counts("broadcast", 1000, 2, 3) == 500
    # allgather: the gathered output, a whole number of elements per rank
    assert sizes.element_counts("allgather", 1024, 4, 3) == 255
    assert sizes.element_counts("allgather", 4, 4, 2) == 2


@pytest.mark.parametrize("collective, nranks, factor", [
    ("allreduce", 1, 0.0), ("allreduce", 2, 1.0), ("allreduce", 4, 1.5),
    ("allgather", 1, 0.0), ("allgather", 2, 0.5), ("allgather", 4, 0.75),
    ("broadcast", 2, 1.0), ("broadcast", 8, 1.0),
])
def test_bus_factor(collective, nranks, factor):
    assert sizes.bus_factor(collective, nranks) == pytest.approx(factor)


def test_bandwidths_follow_nccl_tests():
    # 1 GB in 0.5 s: algbw 2 GB/s; busbw = algbw * 2(n-1)/n for allreduce.
    algbw, busbw = sizes.bandwidths("allreduce", 10**9, 0.5, 4)
    assert algbw == pytest.approx(2.0)
    assert busbw == pytest.approx(3.0)
    assert sizes.bandwidths("allgather", 10**9, 0.5, 4)[1] == pytest.approx(1.5)
    assert sizes.bandwidths("broadcast", 10**9, 0.5, 4)[1] == pytest.approx(2.0)


def test_bus_factor_rejects():
    with pytest.raises(ValueError, match="collective"):
        sizes.bus_factor("alltoall", 2)
    with pytest.raises(ValueError, match="nranks"):
        sizes.bus_factor("allreduce", 0)


@pytest.mark.parametrize("dtype", arguments.DTYPE_NAMES)
@pytest.mark.parametrize("op", arguments.OPS)
def test_inputs_are_reproducible_random_and_not_zero(dtype, op):
    first = checks.make_input(1000, dtype, op, rank=1, nranks=2)
    assert first.dtype == checks.numpy_dtype(dtype) and first.shape == (1000,)
    assert np.array_equal(first.view(np.uint8), checks.make_input(1000, dtype, op, 1, 2)
                          .view(np.uint8))
    other_rank = checks.make_input(1000, dtype, op, rank=0, nranks=2)
    assert not np.array_equal(first.view(np.uint8), other_rank.view(np.uint8))
    assert np.count_nonzero(first.astype(np.float64)) > 900
    assert len(np.unique(first.astype(np.float64))) > 2


def _reduce(op, inputs, dtype):
    stack = np.stack([a.astype(np.float64) for a in inputs])
    return {"sum": stack.sum(0), "min": stack.min(0), "max": stack.max(0),
            "product": stack.prod(0)}[op].astype(dtype)


@pytest.mark.parametrize("dtype", arguments.DTYPE_NAMES)
@pytest.mark.parametrize("op", arguments.OPS)
def test_correct_result_has_no_wrong_elements(dtype, op):
    inputs = [checks.make_input(3001, dtype, op, r, 3) for r in range(3)]
    result = _reduce(op, inputs, checks.numpy_dtype(dtype))
    assert checks.count_wrong_allreduce(result, inputs, op) == 0


@pytest.mark.parametrize("dtype", arguments.DTYPE_NAMES)
def test_wrong_elements_are_counted(dtype):
    inputs = [checks.make_input(5000, dtype, "sum", r, 2) for r in range(2)]
    result = _reduce("sum", inputs, checks.numpy_dtype(dtype))
    result[[0, 17, 4999]] = inputs[0][[0, 17, 4999]]  # one rank's value, not the sum
    assert checks.count_wrong_allreduce(result, inputs, "sum") == 3


def test_wrong_count_spans_chunks(monkeypatch):
    monkeypatch.setattr(checks, "_CHECK_CHUNK_ELEMENTS", 100)
    inputs = [checks.make_input(1050, "float32", "sum", r, 2) for r in range(2)]
    result = inputs[0] + inputs[1]
    assert checks.count_wrong_allreduce(result, inputs, "sum") == 0
    result[[5, 150, 1049]] = np.nan
    assert checks.count_wrong_allreduce(result, inputs, "sum") == 3


def test_wrong_shape_or_dtype_counts_every_element():
    inputs = [checks.make_input(10, "float32", "sum", r, 2) for r in range(2)]
    assert checks.count_wrong_allreduce(np.zeros(9, np.float32), inputs, "sum") == 10
    assert checks.count_wrong_allreduce((inputs[0] + inputs[1]).astype(np.float64), inputs,
                                       "sum") == 10


def test_count_wrong_exact():
    expected = checks.make_input(100, "bfloat16", "sum", 0, 2)
    result = expected.copy()
    assert checks.count_wrong_exact(result, expected) == 0
    result[3] = -result[3]
    assert checks.count_wrong_exact(result, expected) == 1
    assert checks.count_wrong_exact(result[:50], expected) == 100


def test_rows_line_up_with_the_header():
    header = table.header_lines("keras_dist (shm)", "mpi4py")
    row = table.format_row(1 << 20, 1 << 18, "float32", "sum", (1e-4, 10.5, 10.5, 0), 8.0,
                           (2e-4, 5.2, 5.2, 0))
    assert len({len(line) for line in [*header, row]}) == 1
    names = header[1].lstrip("#").split()
    assert names == ["size", "count", "type", "redop", "time(us)", "algbw", "busbw", "#wrong",
                     "%mem", "time(us)", "algbw", "busbw", "#wrong", "%mem", "time", "busbw"]
    cells = row.split()
    assert cells[:9] == ["1048576", "262144", "float32", "sum", "100.00", "10.500", "10.500",
                         "0", "131.2"]
    assert cells[-2:] == ["0.50", "2.02"]


def test_row_without_mpi_and_unchecked():
    row = table.format_row(4, 1, "float32", "sum", (2e-6, 0.002, 0.002, None), 8.0)
    assert row.split() == ["4", "1", "float32", "sum", "2.00", "0.002", "0.002", "N/A", "0.0"]
    assert len(row) == len(table.header_lines("keras_dist (mpi)", None)[1])


@pytest.fixture
def single_rank():
    """keras_dist at size 1 in this process, shut down afterwards if we started it."""
    import keras_dist as kd

    started_here = not kd.is_initialized()
    yield
    if started_here:
        kd.shutdown()


SMALL_RUN = ["-b", "4", "-e", "1K", "-f", "16", "-n", "2", "-w", "1", "--reps", "2",
             "--mem-bytes", "1M", "--vs", "mpi"]


@pytest.mark.parametrize("collective", arguments.COLLECTIVES)
def test_single_rank_run_prints_the_table_and_exits_0(collective, single_rank, capsys):
    assert collectives.main([collective, *SMALL_RUN]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line and not line.startswith("#")]
    assert [row[0] for row in rows] == ["4", "64", "1024"]
    assert all(row[7] == "0" and row[12] == "0" for row in rows), out
    assert "# Out of bounds values : 0 OK" in out


def test_wrong_results_make_the_exit_status_1(single_rank, capsys, monkeypatch):
    monkeypatch.setattr(measure, "count_wrong_allreduce", lambda result, inputs, op: 1)
    assert collectives.main(["allreduce", *SMALL_RUN]) == 1
    out = capsys.readouterr().out
    assert "# Out of bounds values : 6 FAILED" in out  # 3 sizes x (keras_dist, mpi4py)
