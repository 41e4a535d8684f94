"""``init(comm=...)`` with a reordered or partial split of COMM_WORLD, 3 ranks.

The transports must number ranks as the group's communicator does (not in
COMM_WORLD order). The worker checks every collective on every group rank
against numpy references computed from all group ranks' data. One job runs
every case this session asks for, one ``init``/``shutdown`` each; each test
reads its own case's lines from it.
"""

import sys

import pytest

from tests._mp import run_job

WORKER = "tests/multiprocess/workers/user_comm.py"

# (transport, KERAS_DIST_RANKS_PER_NODE, transport name the group gets)
REORDERED = [
    ("shm", None, "shm"),
    ("shm", "2", "hierarchical"),  # pretend machines of 2 + 1 ranks
    ("mpi", None, "mpi"),
]
SUBSET = [
    ("shm", None, "shm"),
    ("shm", "1", "hierarchical"),  # each of the two members a machine of its own
    ("mpi", None, "mpi"),
]


def _case(mode, transport, ranks_per_node):
    """The worker's name for a case: "MODE TRANSPORT [RANKS_PER_NODE]"."""
    return " ".join(filter(None, (mode, transport, ranks_per_node)))


@pytest.fixture(scope="module")
def user_comm_job(request):
    """The job that ran every case of this session's tests of this file, run once."""
    cases = [_case(item.originalname.removeprefix("test_").removesuffix("_communicator"),
                   item.callspec.params["transport"], item.callspec.params["ranks_per_node"])
             for item in request.session.items if item.path == request.path]
    return run_job([sys.executable, WORKER, *cases], np=3, timeout=60 + 60 * len(cases),
                   env={"OMP_NUM_THREADS": "1"})


def _passed(result, mode, transport, ranks_per_node):
    """The job's output for the case; fails unless every rank reported it passed."""
    case = _case(mode, transport, ranks_per_node)
    message = result.describe()
    for rank in range(3):
        assert f"CHECK {case} ok rank={rank}" in result.output(rank), f"{case}\n{message}"
    # A failure of another case explains a failed exit; nothing else does.
    assert result.returncode == 0 or " FAILED rank=" in result.stdout, message
    assert not result.timed_out, message
    return case, message


@pytest.mark.timeout(480)
@pytest.mark.parametrize("transport, ranks_per_node, name", REORDERED)
def test_reordered_communicator(user_comm_job, transport, ranks_per_node, name):
    case, message = _passed(user_comm_job, "reordered", transport, ranks_per_node)
    for world_rank in range(3):
        assert (f"USER COMM OK case={case} world={world_rank} rank={2 - world_rank} size=3 "
                f"transport={name}") in user_comm_job.output(world_rank), message


@pytest.mark.timeout(480)
@pytest.mark.parametrize("transport, ranks_per_node, name", SUBSET)
def test_subset_communicator(user_comm_job, transport, ranks_per_node, name):
    case, message = _passed(user_comm_job, "subset", transport, ranks_per_node)
    assert f"USER COMM OK case={case} world=2 rank=0 size=2 transport={name}" in (
        user_comm_job.output(2)), message
    assert f"USER COMM OK case={case} world=0 rank=1 size=2 transport={name}" in (
        user_comm_job.output(0)), message
    assert f"OUTSIDE case={case} world=1" in user_comm_job.output(1), message
