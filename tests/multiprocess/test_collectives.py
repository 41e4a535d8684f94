"""Every collective at 1, 2 and 3 ranks on each CPU transport (and hierarchical), under kdrun.

The worker checks every result on every rank against a float64 reference it
computes itself; here we only require every rank to report success.
"""

import pytest

from tests.multiprocess._shared_jobs import TEST_TIMEOUT, suite_output


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("transport, np_", [
    # Odd sizes on the shm engine and the hierarchical transport (pretend
    # machines of 2 + 1 ranks), whose splitting is ours; the MPI transport
    # passes sizes to MPICH as they are (tests/multiprocess/_shared_jobs.py).
    ("mpi", 1), ("mpi", 2), ("shm", 2), ("shm", 3), ("hierarchical", 3),
])
def test_every_collective_on_every_rank(transport, np_, tf_job):
    result = tf_job(np_)
    expected = "local" if np_ == 1 else transport
    per_machine = 2 if transport == "hierarchical" else np_
    for rank in range(np_):
        # cross_size: how many machines have a rank with this rank's local rank.
        cross_size = sum(1 for r in range(np_) if r % per_machine == rank % per_machine)
        assert f"COLLECTIVES OK rank={rank} size={np_} transport={expected} " \
            f"cross_size={cross_size}" in suite_output(result, f"collectives-{transport}", rank), \
            result.describe()
