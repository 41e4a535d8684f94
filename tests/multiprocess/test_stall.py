"""A late rank makes the others warn, naming it; a missing one makes them time out."""

import re

import pytest

from tests._mp import run_job

WORKER = "tests/multiprocess/workers/stall.py"


@pytest.fixture(scope="module")
def late_job(request, tmp_path_factory):
    """One job that ran the late-rank case on every transport this session's tests
    ask for (a fresh ``init`` each), run once."""
    transports = [item.callspec.params["transport"] for item in request.session.items
                  if item.path == request.path
                  and item.originalname == "test_late_rank_warns_naming_it_then_completes"]
    # Rank 1 joins once ranks 0 and 2 have warned (workers/stall.py).
    return run_job(["python", WORKER, "late", *transports], np=3,
                   timeout=30 + 60 * len(transports),
                   env={"KERAS_DIST_STALL_CHECK_SECONDS": "1",
                        "STALL_FLAGS": str(tmp_path_factory.mktemp("stall-flags"))})


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["mpi", "shm"])
def test_late_rank_warns_naming_it_then_completes(late_job, transport):
    result = late_job
    message = result.describe()
    for rank in (0, 2):
        output = result.output(rank)
        assert f"CHECK {transport} ok rank={rank}" in output, f"{transport}\n{message}"
        assert f"STALL WARNING case={transport} rank={rank}" in output, message
        warning = output.split(f"STALL WARNING case={transport} rank={rank}:")[1].splitlines()[0]
        assert re.search(r"not joined: \[1\]|for rank 1 \(", warning), message
        assert f"DONE case={transport} rank={rank}" in output, message
    assert f"CHECK {transport} ok rank=1" in result.output(1), message
    # A failure of the other case explains a failed exit; nothing else does.
    assert result.returncode == 0 or " FAILED rank=" in result.stdout, message
    assert not result.timed_out, message


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["mpi", "shm"])
def test_missing_rank_times_out_on_the_waiting_ranks(transport, tmp_path):
    # Rank 1 waits until it is killed: only rank 0's timeout can end the job
    # before the job's own hard timeout.
    result = run_job(["python", WORKER, "never"], np=2, timeout=90, env={
        "KERAS_DIST_CPU_OPERATIONS": transport, "KERAS_DIST_STALL_CHECK_SECONDS": "1",
        "KERAS_DIST_TIMEOUT_SECONDS": "3", "STALL_FLAGS": str(tmp_path)})
    assert not result.timed_out, result.describe()
    assert result.returncode != 0, result.describe()
    assert "TIMEOUT rank=0" in result.output(0), result.describe()
