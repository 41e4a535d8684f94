"""``init(comm=...)`` with a reordered or partial split of COMM_WORLD, 3 ranks.

The transports must number ranks as the group's communicator does (not in
COMM_WORLD order). The worker checks every collective on every group rank
against numpy references computed from all group ranks' data.
"""

import sys

import pytest

from tests._mp import run_job

WORKER = "tests/multiprocess/workers/user_comm.py"

# (transport, KERAS_DIST_RANKS_PER_NODE, transport name the group gets)
TRANSPORTS = [
    ("shm", None, "shm"),
    ("shm", "2", "hierarchical"),  # pretend machines of 2 + 1 ranks
    ("mpi", None, "mpi"),
]


def _run(mode, transport, ranks_per_node):
    return run_job([sys.executable, WORKER, mode], np=3, timeout=150,
                   env={"OMP_NUM_THREADS": "1", "KERAS_DIST_CPU_OPERATIONS": transport,
                        "KERAS_DIST_RANKS_PER_NODE": ranks_per_node}).check()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport, ranks_per_node, name", TRANSPORTS)
def test_reordered_communicator(transport, ranks_per_node, name):
    result = _run("reordered", transport, ranks_per_node)
    for world_rank in range(3):
        assert (f"USER COMM OK world={world_rank} rank={2 - world_rank} size=3 "
                f"transport={name}") in result.output(world_rank), result.describe()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport, ranks_per_node, name", [
    ("shm", None, "shm"),
    ("shm", "1", "hierarchical"),  # each of the two members a machine of its own
    ("mpi", None, "mpi"),
])
def test_subset_communicator(transport, ranks_per_node, name):
    result = _run("subset", transport, ranks_per_node)
    message = result.describe()
    assert f"USER COMM OK world=2 rank=0 size=2 transport={name}" in result.output(2), message
    assert f"USER COMM OK world=0 rank=1 size=2 transport={name}" in result.output(0), message
    assert "OUTSIDE world=1" in result.output(1), message
