"""``join`` with uneven data at 1, 2 and 3 ranks, on every CPU transport.

The worker checks every allreduce against a float64 reference built from the
data of the ranks still active; here every check must be reported passed by
every rank.
"""

import re
from pathlib import Path

import pytest

from tests._mp import run_job

WORKER = Path(__file__).with_name("workers") / "join.py"
TRANSPORTS = {
    "shm": {"KERAS_DIST_CPU_OPERATIONS": "shm"},
    "mpi": {"KERAS_DIST_CPU_OPERATIONS": "mpi"},
    # Two "machines" of one and two ranks: shm inside, MPI between them.
    "hierarchical": {"KERAS_DIST_CPU_OPERATIONS": "shm", "KERAS_DIST_RANKS_PER_NODE": "2"},
}
CASES = [(1, "shm"), (2, "shm"), (2, "mpi"), (3, "shm"), (3, "mpi"), (3, "hierarchical")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("np_", "transport"), CASES, ids=[f"np{n}-{t}" for n, t in CASES])
def test_join_on_every_rank(np_, transport):
    checks = re.findall(r"^def (test_\w+)", WORKER.read_text(), flags=re.M)
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1",
           "KERAS_DIST_TIMEOUT_SECONDS": "60", **TRANSPORTS[transport]}
    if np_ == 3 and transport != "shm":
        env["JOIN_SKIP_TF"] = "1"  # the TF path is the same code; keep the run short
    result = run_job(str(WORKER), np=np_, timeout=200, env=env)
    message = result.describe()
    for rank in range(np_):
        for check in checks:
            assert f"JOIN {check} passed rank={rank}" in result.output(rank), (
                f"{check} on rank {rank}\n{message}")
    result.check()
