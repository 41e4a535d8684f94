"""Mismatched collectives raise on every rank, on both CPU transports, within seconds."""

import pytest

from tests._mp import run_job

WORKER = "tests/multiprocess/workers/mismatch.py"
SCENARIOS = ["shape", "same_count_other_shape", "dtype", "op", "grouped_count", "order",
             "root", "allgather_shape"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["mpi", "shm"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_mismatch_raises_on_every_rank(transport, scenario):
    result = run_job(["python", WORKER, scenario], np=2, timeout=60,
                     env={"KERAS_DIST_CPU_OPERATIONS": transport,
                          "KERAS_DIST_TIMEOUT_SECONDS": "30"})
    assert result.returncode == 0, result.describe()
    for rank in range(2):
        assert f"MISMATCH rank={rank}" in result.output(rank), result.describe()
