"""Every collective at 1, 2 and 3 ranks on each CPU transport, under kdrun.

The worker checks every result on every rank against a float64 reference it
computes itself; here we only require every rank to report success.
"""

import pytest

from tests._mp import run_job

WORKER = "tests/multiprocess/workers/collectives.py"
TF_QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport, np_", [
    ("mpi", 1), ("mpi", 2), ("mpi", 3), ("shm", 2), ("shm", 3),
])
def test_every_collective_on_every_rank(transport, np_):
    result = run_job(WORKER, np=np_, timeout=200,
                     env={**TF_QUIET, "KERAS_DIST_CPU_OPERATIONS": transport})
    result.check()
    expected = "local" if np_ == 1 else transport
    for rank in range(np_):
        assert f"COLLECTIVES OK rank={rank} size={np_} transport={expected}" in \
            result.output(rank), result.describe()
