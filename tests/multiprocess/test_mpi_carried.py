"""Small allreduces on the MPI transport travel in their call's check: every
op and dtype against a float64 reference, a mismatch still raises on every
rank (tests/multiprocess/workers/mpi_carried.py)."""

import pytest

from tests._mp import run_job

WORKER = "tests/multiprocess/workers/mpi_carried.py"


@pytest.mark.timeout(150)
def test_small_allreduces_in_the_check():
    result = run_job(WORKER, np=2, timeout=120,
                     env={"KERAS_DIST_CPU_OPERATIONS": "mpi", "KERAS_DIST_TIMEOUT_SECONDS": "60"})
    result.check()
    for rank in range(2):
        assert f"CARRIED OK rank={rank} transport=mpi" in result.rank_stdout[rank], \
            result.describe()
