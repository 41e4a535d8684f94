"""Fault injection under kdrun: a rank that raises, dies or leaves early, and
signals to the launcher. Each time the job must end promptly (the hard
timeouts here are the bound), non-zero, naming the rank, and leave no process
and no shared-memory file behind."""

import importlib.util
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

from keras_dist.launcher.cleanup import cleanup_shm, shm_snapshot
from tests._mp import TAG_ENV, processes_with_env, run_job, start_job

WORKER = str(Path(__file__).with_name("fault_worker.py"))
# A job that fails must end well within this (issue 5: 30 s for a dead rank).
JOB_TIMEOUT = 30

pytestmark = pytest.mark.timeout(90)

TRANSPORTS = [
    "mpi",
    pytest.param(
        "shm",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("keras_dist.transports.shm") is None,
            reason="no shm transport yet",
        ),
    ),
]


def _shm_used_by_ranks(result):
    names = set()
    for text in result.rank_stdout.values():
        for line in text.splitlines():
            if line.startswith("SHM"):
                names.update(line.split()[1:])
    return names


def _assert_clean_end(result):
    """The job ended by itself, left no process, and no shm file it used."""
    message = result.describe()
    assert not result.timed_out, message
    assert result.leftovers == [], message
    left = sorted(name for name in _shm_used_by_ranks(result)
                  if os.path.exists(os.path.join("/dev/shm", name)))
    assert left == [], f"/dev/shm files of the job left behind: {left}\n{message}"


AMBIGUOUS = "(their exits reached kdrun at once, so which came first is unknown)"


def _assert_rank_1_named_not_rank_0(result):
    """kdrun names rank 1 as the rank that ended, and never blames rank 0 alone.

    When both exits reach kdrun in one wake-up with nothing to order them
    (both already reaped), kdrun names both and says it cannot tell; rank 0
    may also have reported seeing rank 1 die (PeerFailureError).
    """
    message = result.describe()
    lines = result.launcher_stderr.splitlines()
    named = [line for line in lines if "ended without finishing" in line]
    assert named, message
    assert named[0].startswith("kdrun: rank 1 (pid ") or (
        AMBIGUOUS in named[0] and " or rank 1 (pid " in named[0]), message
    for line in lines:
        if line.startswith("kdrun: rank 0 (pid") and AMBIGUOUS not in line:
            assert "raised an exception" in line and "PeerFailureError" in line, message
            assert "rank 1" in line.split("PeerFailureError", 1)[1], message


def _fault(mode, transport="mpi", np_=2, **env):
    return run_job(
        [sys.executable, WORKER, mode], np=np_, timeout=JOB_TIMEOUT,
        env={"KERAS_DIST_CPU_OPERATIONS": transport, **env},
    )


def test_healthy_job_is_clean():
    result = _fault("ok")
    assert result.returncode == 0, result.describe()
    for rank in range(2):
        assert f"FINISHED {rank}" in result.rank_stdout.get(rank, ""), result.describe()
    assert _shm_used_by_ranks(result), result.describe()  # the check below means something
    _assert_clean_end(result)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_exception_in_one_rank_ends_the_job(transport):
    result = _fault("raise", transport, np_=3)
    message = result.describe()
    assert result.returncode != 0, message
    assert "kdrun: rank 1 (pid " in result.launcher_stderr, message
    assert "raised an exception: ValueError: injected fault" in result.launcher_stderr, message
    everything = result.stdout + result.stderr
    assert everything.count("Traceback (most recent call last)") == 1, message
    assert "[keras_dist rank 1/3] ValueError: injected fault" in result.rank_stderr[1], message
    _assert_clean_end(result)


@pytest.mark.parametrize(
    "transport, mode",
    [("mpi", "kill_barrier"), ("mpi", "kill_allreduce"),
     pytest.param("shm", "kill_allreduce", marks=TRANSPORTS[1].marks)],
)
def test_killed_rank_is_named(transport, mode):
    result = _fault(mode, transport)
    message = result.describe()
    assert result.returncode != 0, message
    assert "ended without finishing: killed by a signal or exited early" in (
        result.launcher_stderr), message
    _assert_rank_1_named_not_rank_0(result)
    _assert_clean_end(result)


def test_rank_exiting_early_with_status_0_fails_the_job():
    # hydra itself reports success here, after SIGKILLing rank 0.
    result = _fault("exit0")
    message = result.describe()
    assert result.returncode != 0, message
    _assert_rank_1_named_not_rank_0(result)
    _assert_clean_end(result)


def test_rank_exit_status_is_passed_on():
    result = _fault("exit3")
    # kdrun passes on mpiexec's status: hydra's is that of the first failed
    # process it reaped, rank 1's 3, unless it reaped rank 0, which it had
    # already SIGKILLed, first; its banner then reports that one's 9.
    banner = re.search(r"EXIT CODE: (\d+)", result.launcher_stdout)
    assert result.returncode == (int(banner[1]) if banner else 3), result.describe()
    assert result.returncode in (3, 9), result.describe()
    _assert_rank_1_named_not_rank_0(result)
    _assert_clean_end(result)


def test_failure_before_init_is_reported():
    result = _fault("raise_before_init")
    message = result.describe()
    assert result.returncode != 0, message
    assert "RuntimeError: injected fault before init" in result.rank_stderr.get(1, ""), message
    # hydra alone would wait forever: rank 0 sits in MPI start-up for rank 1.
    assert "kdrun: rank 1 exited before keras_dist.init() while rank 0 waited" in (
        result.launcher_stderr), message
    assert not result.timed_out and result.leftovers == [], message


def _start_and_wait_ready(mode, np_=2):
    ready_dir = tempfile.mkdtemp(prefix="kdready-")
    job = start_job([sys.executable, WORKER, mode], np=np_,
                    env={"FAULT_READY_DIR": ready_dir})
    deadline = time.monotonic() + JOB_TIMEOUT
    while len(os.listdir(ready_dir)) < np_:
        if job.proc.poll() is not None or time.monotonic() > deadline:
            result = job.wait(1)
            pytest.fail("ranks never got ready\n" + result.describe())
        time.sleep(0.1)
    return job


@pytest.mark.parametrize(
    "signum, mode",
    [
        (signal.SIGINT, "hang"),
        # Ranks that ignore the signal are killed after kdrun's grace period.
        (signal.SIGTERM, "hang_ignoring_signals"),
    ],
)
def test_signal_to_kdrun_stops_everything(signum, mode):
    job = _start_and_wait_ready(mode)
    job.send_signal(signum)
    result = job.wait(JOB_TIMEOUT)
    message = result.describe()
    assert result.returncode == 128 + signum, message
    assert f"kdrun: {signal.Signals(signum).name} received" in result.launcher_stderr, message
    _assert_clean_end(result)


def test_kdrun_killed_takes_the_job_with_it():
    # Nothing is left to clean /dev/shm then (MPICH's segment stays, and this
    # test removes it as kdrun would have); but no rank may run on.
    before = shm_snapshot()
    job = _start_and_wait_ready("hang")
    job.proc.kill()
    deadline = time.monotonic() + 15
    while processes_with_env(TAG_ENV, job.tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in processes_with_env(TAG_ENV, job.tag) if pid != job.pid]
    result = job.wait(5)
    cleanup_shm("kdrun-was-killed", before)
    assert left == [], f"processes of the job outlived kdrun: {left}\n{result.describe()}"


FIT_WORKER = str(Path(__file__).with_name("fit_worker.py"))


@pytest.mark.slow  # TensorFlow start-up in every rank
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "transport, kind, step",
    [("mpi", "kill", 11), ("shm", "kill", 11), ("mpi", "raise", 5)],
)
def test_fault_in_the_middle_of_fit(transport, kind, step):
    if transport == "shm" and importlib.util.find_spec("keras_dist.transports.shm") is None:
        pytest.skip("no shm transport yet")
    result = run_job(
        [sys.executable, FIT_WORKER], np=2, timeout=120,
        env={"KERAS_DIST_CPU_OPERATIONS": transport, "FAULT_STEP": str(step),
             "FAULT_KIND": kind},
    )
    message = result.describe()
    assert f"FAULT at step {step}" in result.rank_stdout.get(1, ""), message
    assert result.returncode != 0, message
    if kind == "kill":
        _assert_rank_1_named_not_rank_0(result)
    else:
        expected = f"raised an exception: RuntimeError: injected fault at step {step}"
        assert expected in result.launcher_stderr, message
        assert "kdrun: rank 0 (pid" not in result.launcher_stderr, message
    _assert_clean_end(result)
