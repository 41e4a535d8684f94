"""``join`` with uneven data at 1, 2 and 3 ranks, on every CPU transport.

The worker checks every allreduce against a float64 reference built from the
data of the ranks still active; here every check must be reported passed by
every rank.
"""

import re
from pathlib import Path

import pytest

from tests.multiprocess._shared_jobs import TEST_TIMEOUT, suite_output

WORKER = Path(__file__).with_name("workers") / "join.py"
# Transports (tests/multiprocess/_shared_jobs.py): shm, mpi, and two "machines" of
# one and two ranks (shm inside, MPI between them); at 3 ranks the TF path only on shm.
CASES = [(1, "shm"), (2, "shm"), (2, "mpi"), (3, "shm"), (3, "mpi"), (3, "hierarchical")]


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize(("np_", "transport"), CASES, ids=[f"np{n}-{t}" for n, t in CASES])
def test_join_on_every_rank(np_, transport, tf_job):
    checks = re.findall(r"^def (test_\w+)", WORKER.read_text(), flags=re.M)
    result = tf_job(np_)
    for rank in range(np_):
        output = suite_output(result, f"join-{transport}", rank)
        for check in checks:
            assert f"JOIN {check} passed rank={rank}" in output, (
                f"{check} on rank {rank}\n{result.describe()}")
