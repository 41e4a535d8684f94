"""The MPI transport's pipelined ring among three machines (pretend ones, one
rank each), every op and several dtypes against float64, every rank with the
same bytes (tests/multiprocess/workers/mpi_ring.py)."""

import pytest

from tests._mp import run_job

WORKER = "tests/multiprocess/workers/mpi_ring.py"


@pytest.mark.timeout(150)
def test_the_ring_among_three_machines():
    result = run_job(WORKER, np=3, timeout=120,
                     env={"KERAS_DIST_CPU_OPERATIONS": "mpi", "KERAS_DIST_RANKS_PER_NODE": "1",
                          "KERAS_DIST_TIMEOUT_SECONDS": "60"})
    result.check()
    for rank in range(3):
        assert f"RING OK rank={rank} size=3 ring=True" in result.rank_stdout[rank], \
            result.describe()
