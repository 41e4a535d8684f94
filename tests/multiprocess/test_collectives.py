"""Every collective at 1, 2 and 3 ranks on each CPU transport (and hierarchical), under kdrun.

The worker checks every result on every rank against a float64 reference it
computes itself; here we only require every rank to report success.
"""

import pytest

from tests._mp import run_job

WORKER = "tests/multiprocess/workers/collectives.py"
TF_QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport, np_, ranks_per_node", [
    # Odd sizes on the shm engine and the hierarchical transport, whose
    # splitting is ours; the MPI transport passes sizes to MPICH as they are.
    ("mpi", 1, None), ("mpi", 2, None), ("shm", 2, None), ("shm", 3, None),
    ("shm", 3, "2"),  # hierarchical: pretend machines of 2 + 1 ranks
])
def test_every_collective_on_every_rank(transport, np_, ranks_per_node):
    result = run_job(WORKER, np=np_, timeout=200,
                     env={**TF_QUIET, "KERAS_DIST_CPU_OPERATIONS": transport,
                          "KERAS_DIST_RANKS_PER_NODE": ranks_per_node})
    result.check()
    expected = "local" if np_ == 1 else "hierarchical" if ranks_per_node else transport
    per_machine = int(ranks_per_node or np_)
    for rank in range(np_):
        # cross_size: how many machines have a rank with this rank's local rank.
        cross_size = sum(1 for r in range(np_) if r % per_machine == rank % per_machine)
        assert f"COLLECTIVES OK rank={rank} size={np_} transport={expected} " \
            f"cross_size={cross_size}" in result.output(rank), result.describe()
