"""After a mismatch the group stays usable; a rank whose peer left raises instead of waiting.

Both on every CPU transport: shm, mpi, and hierarchical (pretend machines via
``KERAS_DIST_RANKS_PER_NODE``), so mismatches inside one machine and between
machines are both covered.
"""

import pytest

from tests._mp import run_job

RECOVERY = "tests/multiprocess/workers/recovery.py"
DEPARTURE = "tests/multiprocess/workers/departure.py"
QUIET = {"OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}


def _env(transport: str, ranks_per_node: str | None) -> dict:
    return {**QUIET, "KERAS_DIST_CPU_OPERATIONS": transport,
            "KERAS_DIST_RANKS_PER_NODE": ranks_per_node, "KERAS_DIST_TIMEOUT_SECONDS": "30"}


MISMATCH_CASES = [
    ("shm", 2, None, "shm"), ("shm", 3, None, "shm"), ("mpi", 2, None, "mpi"),
    ("mpi", 3, None, "mpi"),
    ("shm", 3, "2", "hierarchical"),  # machines of 2 + 1 ranks
    ("shm", 3, "1", "hierarchical"),  # one rank per machine
    ("shm", 4, "2", "hierarchical"),  # two machines of two: mismatches inside the second
]


def _case(transport: str, ranks_per_node: str | None) -> str:
    """The worker's name for a case: "TRANSPORT [RANKS_PER_NODE]"."""
    return " ".join(filter(None, (transport, ranks_per_node)))


@pytest.fixture(scope="module")
def recovery_job(request):
    """``recovery_job(np_)``: one job of ``np_`` ranks that ran every case of that
    size this session's tests ask for (a fresh ``init`` each), run once."""
    wanted = [(item.callspec.params["np_"], _case(item.callspec.params["transport"],
                                                  item.callspec.params["ranks_per_node"]))
              for item in request.session.items
              if item.path == request.path
              and item.originalname == "test_mismatches_leave_the_group_usable"]
    jobs = {}

    def result(np_: int):
        if np_ not in jobs:
            cases = [case for n, case in wanted if n == np_]
            jobs[np_] = run_job(["python", RECOVERY, *cases], np=np_,
                                timeout=60 + 140 * len(cases),
                                env={**QUIET, "KERAS_DIST_TIMEOUT_SECONDS": "30"})
        return jobs[np_]

    return result


@pytest.mark.timeout(700)
@pytest.mark.parametrize("transport, np_, ranks_per_node, name", MISMATCH_CASES)
def test_mismatches_leave_the_group_usable(recovery_job, transport, np_, ranks_per_node, name):
    result = recovery_job(np_)
    case = _case(transport, ranks_per_node)
    message = result.describe()
    scenarios = 10 if np_ == 2 else 30
    for rank in range(np_):
        assert f"CHECK {case} ok rank={rank}" in result.output(rank), f"{case}\n{message}"
        assert f"RECOVERY OK case={case} rank={rank} size={np_} transport={name} " \
            f"scenarios={scenarios}" in result.output(rank), message
    # A failure of another case explains a failed exit; nothing else does.
    assert result.returncode == 0 or " FAILED rank=" in result.stdout, message
    assert not result.timed_out, message


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport, np_, ranks_per_node, mode", [
    ("shm", 2, None, "after"), ("shm", 3, None, "waiting"), ("mpi", 2, None, "after"),
    ("mpi", 3, None, "waiting"), ("shm", 3, "2", "after"), ("shm", 3, "2", "waiting"),
])
def test_peer_that_shut_down_raises_instead_of_waiting(transport, np_, ranks_per_node, mode):
    result = run_job(["python", DEPARTURE, mode], np=np_, timeout=90,
                     env=_env(transport, ranks_per_node))
    result.check()
    for rank in range(1, np_):
        assert f"DEPARTED rank={rank} " in result.output(rank), result.describe()
