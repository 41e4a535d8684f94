"""A tiny 2-rank run of ``python -m keras_dist.bench`` under kdrun, on each CPU transport.

Checks that it ran, printed nccl-tests' columns on rank 0 only, named the
transport that ran and reported no wrong elements. No timing is asserted.
"""

import re
import sys

import pytest

from tests._mp import run_job

TRANSPORTS = ["mpi", "shm"]

COLUMNS = ["size", "count", "type", "redop", "time(us)", "algbw", "busbw", "#wrong", "%mem",
           "time(us)", "algbw", "busbw", "#wrong", "%mem", "time", "busbw"]


def _rows(text):
    return [line.split() for line in text.splitlines() if line and not line.startswith("#")]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("collective, dtype, op", [
    ("allreduce", "float32", "sum"),
    ("allreduce --inplace", "int64", "product"),
    ("allreduce", "bfloat16", "max"),
    ("broadcast", "int32", "sum"),
    ("allgather", "float16", "sum"),
])
def test_bench_runs_checked_side_by_side(transport, collective, dtype, op):
    collective, *extra = collective.split()
    command = [sys.executable, "-m", "keras_dist.bench", collective, *extra, "-b", "4",
               "-e", "300K", "-f", "32", "--dtype", dtype, "--transport", transport, "--vs", "mpi",
               "-n", "3", "-w", "1", "--reps", "2", "--mem-bytes", "4M"]
    if collective == "allreduce":
        command += ["--op", op]
    result = run_job(command, np=2, timeout=150, env={"OMP_NUM_THREADS": "1"})
    result.check()
    out = result.rank_stdout.get(0, "")
    assert f"transport {transport}" in out, result.describe()
    assert "# memory copy:" in out, result.describe()
    header = [line for line in out.splitlines() if "#wrong" in line]
    assert len(header) == 1 and header[0].lstrip("#").split() == COLUMNS, result.describe()
    rows = _rows(out)
    # 4, 128, 4K, 128K bytes (fewer when the dtype makes two steps the same count)
    assert 3 <= len(rows) <= 4, result.describe()
    for row in rows:
        assert len(row) == len(COLUMNS), result.describe()
        assert row[2] == dtype and row[3] == (op if collective == "allreduce" else "none")
        assert row[7] == "0" and row[12] == "0", result.describe()
        assert float(row[4]) > 0 and float(row[9]) > 0, result.describe()
    assert "# Out of bounds values : 0 OK" in out, result.describe()
    assert out.count("# Avg bus bandwidth") == 2, result.describe()
    assert _rows(result.rank_stdout.get(1, "")) == [], "only rank 0 prints"


@pytest.mark.timeout(200)
def test_overlap_probe_benchmark_runs_and_checks_weights():
    # Every keras_dist model of the script ends equal on every rank.
    result = run_job([sys.executable, "benchmarks/overlap_probe.py", "--model", "mlp",
                      "--steps", "2", "--reps", "2"], np=2, timeout=150,
                     env={"OMP_NUM_THREADS": "1"})
    result.check()
    out = result.rank_stdout.get(0, "")
    assert "#wrong 0" in out, result.describe()
    rows = _rows(out)
    assert [row[0] for row in rows] == ["0", "1"], result.describe()
    assert all(float(value) > 0 for row in rows for value in row[1:4]), result.describe()


@pytest.mark.timeout(200)
def test_parts_floor_benchmark_checks_results_and_removes_its_segment():
    import glob

    before = set(glob.glob("/dev/shm/psm_*"))
    result = run_job([sys.executable, "benchmarks/parts_floor.py", "--model", "cnn",
                      "--calls", "2", "--reps", "1", "--flush-mb", "1"], np=2, timeout=150,
                     env={"OMP_NUM_THREADS": "1"})
    result.check()
    out = result.rank_stdout.get(0, "")
    assert "#wrong 0" in out, result.describe()
    rows = {line[:30].strip(): line[30:].split() for line in out.splitlines()
            if line.startswith("  ")}
    assert set(rows) == {"allreduce_parts", "read from a peer (floor)",
                         "local copy of the message", "allreduce_parts / floor"}, out
    assert all(float(v) > 0 for values in rows.values() for v in values), out
    assert set(glob.glob("/dev/shm/psm_*")) <= before, "parts_floor.py left its segment"


@pytest.mark.timeout(200)
def test_tf_op_ab_benchmark_times_both_ops_and_the_baseline():
    result = run_job([sys.executable, "benchmarks/tf_op_ab.py", "--model", "mlp", "--iters", "2",
                      "--steps", "2"], np=2, timeout=150, env={"OMP_NUM_THREADS": "1"})
    result.check()
    out = result.rank_stdout.get(0, "")
    steps = {line.split("median step")[0].strip():
             float(re.search(r"median step\s+([\d.]+) ms", line)[1])
             for line in out.splitlines() if "median step" in line}
    assert set(steps) == {"numpy_function", "keras_dist op", "plain"}, out
    assert all(value > 0 for value in steps.values()), out
    efficiency = [line for line in out.splitlines() if "efficiency" in line]
    assert len(efficiency) == 2 and all("waiting" in line for line in efficiency), out


@pytest.mark.timeout(200)
def test_aligned_steps_benchmark_times_both_kinds_on_every_rank():
    result = run_job([sys.executable, "benchmarks/aligned_steps.py", "--model", "mlp",
                      "--blocks", "2", "--steps", "2"], np=2, timeout=150,
                     env={"OMP_NUM_THREADS": "1"})
    result.check()
    out = result.rank_stdout.get(0, "")
    found = re.findall(r"^rank (\d): step aligned ([\d.]+) ms, free ([\d.]+) ms, "
                       r"aligned/free ([\d.]+)$", out, flags=re.M)
    assert [rank for rank, *_ in found] == ["0", "1"], result.describe()
    for _, aligned, free, ratio in found:
        assert float(aligned) > 0 and float(free) > 0, out
        assert abs(float(ratio) - float(aligned) / float(free)) < 0.01, out  # printed rounded


@pytest.mark.timeout(120)
def test_rendezvous_formation_benchmark_forms_each_way():
    import subprocess

    done = subprocess.run([sys.executable, "benchmarks/rendezvous_formation.py", "--sizes", "2",
                           "--reps", "1"], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = re.findall(r"^\s+2\s+(self-started|mpiexec|kdrun)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$",
                      done.stdout, flags=re.M)
    assert [way for way, *_ in rows] == ["self-started", "mpiexec", "kdrun"], done.stdout
    assert dict((way, float(ratio)) for way, *_, ratio in rows)["mpiexec"] == 1.0, done.stdout
