"""Mismatched collectives raise on every rank, on both CPU transports, within seconds."""

import pytest

from tests._mp import run_job

WORKER = "tests/multiprocess/workers/mismatch.py"
SCENARIOS = ["shape", "same_count_other_shape", "dtype", "op", "grouped_count", "order",
             "root", "allgather_shape"]


@pytest.fixture(scope="module", params=["mpi", "shm"])
def every_scenario(request):
    """One 2-rank job per transport runs every scenario (workers/mismatch.py)."""
    return run_job(["python", WORKER, *SCENARIOS], np=2, timeout=120,
                   env={"KERAS_DIST_CPU_OPERATIONS": request.param,
                        "KERAS_DIST_TIMEOUT_SECONDS": "30"})


@pytest.mark.timeout(180)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_mismatch_raises_on_every_rank(every_scenario, scenario):
    result = every_scenario
    for rank in range(2):
        assert f"MISMATCH rank={rank} scenario={scenario}: " in result.output(rank), \
            result.describe()
    assert result.returncode == 0, result.describe()
