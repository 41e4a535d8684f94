"""A late rank makes the others warn, naming it; a missing one makes them time out."""

import re

import pytest

from tests._mp import run_job

WORKER = "tests/multiprocess/workers/stall.py"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["mpi", "shm"])
def test_late_rank_warns_naming_it_then_completes(transport, tmp_path):
    # Rank 1 joins once ranks 0 and 2 have warned (workers/stall.py).
    result = run_job(["python", WORKER, "late"], np=3, timeout=90, env={
        "KERAS_DIST_CPU_OPERATIONS": transport, "KERAS_DIST_STALL_CHECK_SECONDS": "1",
        "STALL_FLAGS": str(tmp_path)})
    result.check()
    for rank in (0, 2):
        output = result.output(rank)
        assert f"STALL WARNING rank={rank}" in output, result.describe()
        warning = output.split(f"STALL WARNING rank={rank}:")[1].splitlines()[0]
        assert re.search(r"not joined: \[1\]|for rank 1 \(", warning), result.describe()
        assert f"DONE rank={rank}" in output, result.describe()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["mpi", "shm"])
def test_missing_rank_times_out_on_the_waiting_ranks(transport, tmp_path):
    # Rank 1 waits until it is killed: only rank 0's timeout can end the job
    # before the job's own hard timeout.
    result = run_job(["python", WORKER, "never"], np=2, timeout=90, env={
        "KERAS_DIST_CPU_OPERATIONS": transport, "KERAS_DIST_STALL_CHECK_SECONDS": "1",
        "KERAS_DIST_TIMEOUT_SECONDS": "3", "STALL_FLAGS": str(tmp_path)})
    assert not result.timed_out, result.describe()
    assert result.returncode != 0, result.describe()
    assert "TIMEOUT rank=0" in result.output(0), result.describe()
