"""A tiny 2-rank run of ``python -m keras_dist.bench latency`` on each CPU transport.

Checks the rows and that every result was right; no timing is asserted.
"""

import sys

import pytest

from tests._mp import run_job

TRANSPORTS = ["mpi", "shm"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_latency_benchmark_checks_every_row(transport):
    command = [sys.executable, "-m", "keras_dist.bench", "latency", "-b", "4", "-e", "4K",
               "-f", "32", "-n", "3", "-w", "1", "--reps", "2", "--transport", transport]
    result = run_job(command, np=2, timeout=150, env={"OMP_NUM_THREADS": "1"})
    result.check()
    out = result.rank_stdout.get(0, "")
    assert f"transport {transport}" in out, result.describe()
    assert "# load average before:" in out and "# load average after:" in out
    rows = [line.split() for line in out.splitlines() if line and not line.startswith("#")]
    # 4, 128 and 4096 bytes of each collective (allgather: 8 = one float32 per rank)
    assert [(row[0], row[1]) for row in rows] == [
        ("allreduce", "4"), ("allreduce", "128"), ("allreduce", "4096"),
        ("broadcast", "4"), ("broadcast", "128"), ("broadcast", "4096"),
        ("allgather", "8"), ("allgather", "128"), ("allgather", "4096"),
    ], result.describe()
    for row in rows:
        assert len(row) == 9 and row[-1] == "0", result.describe()
        assert float(row[2]) > 0 and float(row[4]) > 0
        # The engine's entry and its wait counter exist on the shm transport only.
        assert (row[3] == "-") == (transport == "mpi"), result.describe()
    assert "# Out of bounds values : 0 OK" in out, result.describe()
    assert result.rank_stdout.get(1, "").strip() == "", "only rank 0 prints"
