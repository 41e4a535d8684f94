"""Processes that started themselves (torchrun's or Kubeflow's variables, or
``init(rendezvous=...)``), with no kdrun and no mpiexec, form the job kdrun
gives: every collective, process sets and mismatch errors as under kdrun; a
dead or failing rank ends every rank within a bounded time, naming it; a
rendezvous that cannot form fails with one sentence; nothing is left behind.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests._mp import REPO_ROOT, TAG_ENV, job_environment, processes_with_env
from tests._selfstart import free_port, run_self_started, torchrun_variables
from tests.multiprocess._shared_jobs import suite_output

WORKERS = REPO_ROOT / "tests" / "multiprocess" / "workers"
SELF = str(WORKERS / "self_started.py")
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1",
         "KERAS_DIST_TIMEOUT_SECONDS": "60", "KERAS_DIST_RENDEZVOUS_TIMEOUT": "60"}


SECRET = "0123456789abcdef0123456789abcdef"


def mapped_mpich_segments(result) -> set[str]:
    """The MPICH segments the ranks said they mapped (``UP ... mpich_segments=``)."""
    return {name for rank in range(len(result.rank_stdout))
            for match in re.findall(r"mpich_segments=(\S*)", result.output(rank))
            for name in match.split(",") if name}


# The workers that share one self-started job per size: workers/suites.py
# runs them one after another (kd.shutdown() in between), so one start of
# Python, TensorFlow and the rendezvous serves several tests. Each test reads
# its own worker's output (suite_output): it fails by name, with every rank's
# output. Each entry: (size, the test that reads it, spec), in the job's order.
MISMATCH_SCENARIOS = ["shape", "dtype", "op", "order", "root"]
SHARED_WORKERS = [
    (2, "test_every_collective_with_torchruns_variables",
     {"label": "collectives", "path": "workers/collectives.py"}),
    (2, "test_mismatched_collectives_raise_on_every_rank",
     {"label": "mismatch", "path": "workers/mismatch.py", "args": MISMATCH_SCENARIOS,
      "env": {"KERAS_DIST_TIMEOUT_SECONDS": "30"}}),
    (2, "test_the_mnist_example_with_torchruns_variables",
     {"label": "mnist", "path": str(REPO_ROOT / "examples" / "mnist" / "train.py"),
      "args": ["--epochs", "1", "--checkpoint-dir", "{checkpoints}"]}),
    # First at 3 ranks, so that it counts only its own shared memory.
    (3, "test_process_sets_with_torchruns_variables",
     {"label": "process_sets", "path": "workers/process_sets.py", "args": ["static"]}),
    (3, "test_every_collective_with_torchruns_variables",
     {"label": "collectives", "path": "workers/collectives.py"}),
]
# process_sets.py imports mpi4py.MPI before kd.init(), as under mpiexec: at 3
# ranks the processes meet first (workers/join_first.py), and each worker's
# kd.init() finds the job formed; at 2, the collectives' kd.init() forms it.
SHARED_JOB_START = {2: [], 3: [str(WORKERS / "join_first.py")]}
#: The hard timeout of a shared job (about the sum of its workers' former
#: jobs' timeouts), and the pytest timeout of the tests that read one.
SHARED_JOB_TIMEOUT = 520
SHARED_TEST_TIMEOUT = SHARED_JOB_TIMEOUT + 40


@pytest.fixture(scope="module")
def self_started_job(request, tmp_path_factory):
    """``self_started_job(np_)``: the result of the shared self-started job of
    ``np_`` ranks, run once, with the workers of the tests this session runs."""
    here = Path(__file__).resolve()
    wanted = {item.originalname for item in request.session.items
              if item.path.resolve() == here}
    checkpoints = str(tmp_path_factory.mktemp("mnist_checkpoints"))
    results = {}

    def result(np_):
        if np_ not in results:
            specs = [json.dumps({**spec, "args": [arg.format(checkpoints=checkpoints)
                                                  for arg in spec.get("args", [])]})
                     for size, test, spec in SHARED_WORKERS if size == np_ and test in wanted]
            results[np_] = run_self_started([sys.executable, *SHARED_JOB_START[np_],
                                             str(WORKERS / "suites.py"), *specs],
                                            np=np_, timeout=SHARED_JOB_TIMEOUT, env=QUIET)
        return results[np_]
    return result


@pytest.mark.timeout(SHARED_TEST_TIMEOUT)
@pytest.mark.parametrize("np_", [2, 3])
def test_every_collective_with_torchruns_variables(np_, self_started_job):
    result = self_started_job(np_)
    for rank in range(np_):
        assert f"COLLECTIVES OK rank={rank} size={np_} transport=shm cross_size=1" in \
            suite_output(result, "collectives", rank), result.describe()
    assert not result.leftovers, result.describe()


@pytest.mark.timeout(SHARED_TEST_TIMEOUT)
def test_process_sets_with_torchruns_variables(self_started_job):
    result = self_started_job(3)
    for rank in range(3):
        assert f"PSETS shutdown passed rank={rank}" in \
            suite_output(result, "process_sets", rank), result.describe()


@pytest.mark.timeout(SHARED_TEST_TIMEOUT)
def test_mismatched_collectives_raise_on_every_rank(self_started_job):
    result = self_started_job(2)
    for rank in range(2):
        output = suite_output(result, "mismatch", rank)
        for scenario in MISMATCH_SCENARIOS:
            assert f"MISMATCH rank={rank} scenario={scenario}: " in output, result.describe()


def kubeflow_variables(nodes, port):
    def variables(rank):
        return {"PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(rank),
                "PET_MASTER_ADDR": "localhost", "PET_MASTER_PORT": str(port)}
    return variables


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["torchrun", "kubeflow", "explicit"])
def test_each_way_of_being_placed_forms_the_job(how, tmp_path):
    np_, port, env = 3, free_port(), dict(QUIET)
    if how == "torchrun":  # with a secret in the environment
        variables, mode = torchrun_variables(np_, port), "report"
        env["KERAS_DIST_SECRET"] = SECRET
    elif how == "kubeflow":  # with a secret in a file, as a mounted Kubernetes Secret
        variables, mode = kubeflow_variables(np_, port), "report"
        (tmp_path / "secret").write_text(SECRET + "\n")
        env["KERAS_DIST_SECRET_FILE"] = str(tmp_path / "secret")
    else:
        def variables(rank):
            return {"KD_TEST_RENDEZVOUS": f"127.0.0.1:{port}", "KD_TEST_RANK": str(rank),
                    "KD_TEST_SIZE": str(np_)}
        mode = "explicit"
    result = run_self_started([sys.executable, SELF, mode], np=np_, timeout=100, env=env,
                              variables=variables)
    result.check()
    for rank in range(np_):
        # One machine: the shared-memory engine among all of them.
        assert f"SELF rank={rank} size={np_} local={rank}/{np_} cross=0/1 attempt=- ok " \
            "secret_left=[]" in result.output(rank), result.describe()
    assert not result.leftovers, result.describe()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim, fault", [(1, "kill"), (0, "kill"), (2, "raise")])
def test_a_failing_rank_ends_every_rank_naming_it(victim, fault):
    result = run_self_started([sys.executable, SELF, "loop"], np=3, timeout=100,
                              env={**QUIET, "KD_TEST_VICTIM": str(victim),
                                   "KD_TEST_FAULT": fault})
    assert not result.timed_out, result.describe()
    what = "aborted the job" if fault == "raise" else "ended before MPI finished"
    for rank in range(3):
        assert result.output(rank).count("UP rank=") == 1, result.describe()
        if rank != victim:
            assert f"[keras_dist rank {rank}/3] ending this rank: rank {victim} (host " in \
                result.output(rank), result.describe()
            assert what in result.output(rank), result.describe()
        else:  # the failing rank ends on its own, without a word about itself
            assert "ending this rank" not in result.output(rank), result.describe()
    assert result.returncode != 0
    assert not result.leftovers, result.describe()
    segments = mapped_mpich_segments(result)
    assert segments, f"no rank mapped MPICH's shared memory: {result.describe()}"
    left = [name for name in segments if os.path.exists(f"/dev/shm/{name}")]
    assert not left, f"MPICH's shared memory was left behind: {left}"


@pytest.mark.timeout(60)
def test_a_rank_given_another_world_size_stops_the_start_on_every_rank():
    port = free_port()
    torchrun = torchrun_variables(2, port)

    def variables(rank):
        return {**torchrun(rank), "WORLD_SIZE": "3"} if rank == 1 else torchrun(rank)
    result = run_self_started([sys.executable, SELF, "report"], np=2, timeout=50, env=QUIET,
                              variables=variables)
    assert not result.timed_out and result.returncode != 0, result.describe()
    for rank in range(2):
        assert "rank 1 (host" in result.output(rank) and "was told the job has 3 processes, " \
            "rank 0 was told 2: every process must be given the same world size" in \
            result.output(rank), result.describe()
        assert "UP rank=" not in result.output(rank)
    assert not result.leftovers, result.describe()


@pytest.mark.timeout(60)
def test_ranks_given_different_secrets_fail_in_one_sentence_not_a_hang():
    port = free_port()
    torchrun = torchrun_variables(2, port)

    def variables(rank):
        return {**torchrun(rank), "KERAS_DIST_SECRET": SECRET if rank == 0 else SECRET[::-1]}
    result = run_self_started([sys.executable, SELF, "report"], np=2, timeout=50,
                              env={**QUIET, "KERAS_DIST_RENDEZVOUS_TIMEOUT": "5"},
                              variables=variables)
    assert not result.timed_out and result.returncode != 0, result.describe()
    assert f"rank 1 of 2: the rendezvous at 127.0.0.1:{port} (torchrun's variables) and this " \
           "rank hold different secrets: set the same KERAS_DIST_SECRET (or " \
           "KERAS_DIST_SECRET_FILE) on every rank, or on none." in result.output(1), \
        result.describe()
    assert "ranks [1] of 2 did not reach the rendezvous within 5 s" in result.output(0), \
        result.describe()
    assert "1 connection(s) did not prove the job's secret" in result.output(0), \
        result.describe()
    assert "UP rank=" not in result.output(0) + result.output(1)
    assert not result.leftovers, result.describe()


def _alone(variables):
    """One process of a larger job, started alone with a rendezvous timeout of
    2 s: its start must fail, within the timeout."""
    result = run_self_started([sys.executable, SELF, "report"], np=1, timeout=50,
                              env={**QUIET, "KERAS_DIST_RENDEZVOUS_TIMEOUT": "2"},
                              variables=variables)
    assert not result.timed_out and result.returncode != 0, result.describe()
    return result


@pytest.mark.timeout(60)
def test_a_rank_that_never_comes_is_named_within_the_rendezvous_timeout():
    result = _alone(torchrun_variables(3, free_port()))  # rank 0 of 3, the others never start
    assert "ranks [1, 2] of 3 did not reach the rendezvous within 2 s " \
           "(KERAS_DIST_RENDEZVOUS_TIMEOUT)" in result.output(0), result.describe()
    assert "RendezvousError" in result.output(0), result.describe()
    assert not result.leftovers, result.describe()


@pytest.mark.timeout(60)
def test_a_rendezvous_nobody_listens_on_is_named_within_the_timeout():
    port = free_port()
    torchrun = torchrun_variables(2, port)
    result = _alone(lambda rank: torchrun(1))  # rank 1 without rank 0
    assert f"rank 1 of 2 could not reach the rendezvous at 127.0.0.1:{port} (torchrun's " \
           "variables) within 2 s (KERAS_DIST_RENDEZVOUS_TIMEOUT)" in result.output(0), \
        result.describe()


@pytest.mark.timeout(60)
def test_mpi_started_before_init_is_named():
    result = run_self_started([sys.executable, SELF, "mpi_first"], np=1, timeout=50, env=QUIET,
                              variables=lambda rank: torchrun_variables(2, free_port())(1))
    assert result.returncode != 0, result.describe()
    assert "torchrun's variables place this process as rank 1 of 2, but MPI was started in " \
           "it before kd.init() (a job of 1): call kd.init() before anything imports " \
           "mpi4py.MPI." in result.output(0), result.describe()


@pytest.mark.slow
@pytest.mark.timeout(SHARED_TEST_TIMEOUT)
def test_the_mnist_example_with_torchruns_variables(self_started_job):
    result = self_started_job(2)
    output = suite_output(result, "mnist", 0)
    assert "weights on every rank: identical" in output, result.describe()
    assert "test accuracy: " in output, result.describe()
    assert not result.leftovers, result.describe()


def _torchrun() -> str:
    """The torchrun of this Python (the torch wheel's), or the test skips."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun (torch) is not installed")
    return torchrun


@pytest.mark.timeout(120)
def test_under_torchrun_itself_and_restarted_by_it():
    """torchrun's agent holds MASTER_PORT (keras_dist meets one above it); a
    rank that fails ends the attempt, and torchrun's restart forms the job again."""
    torchrun = _torchrun()
    env = job_environment(QUIET, None)
    done = subprocess.run([torchrun, "--nproc-per-node", "2", "--max-restarts", "1",
                           "--master-port", str(free_port()), SELF, "restart"],
                          capture_output=True, text=True, env=env, timeout=100,
                          cwd=str(REPO_ROOT))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "rank 1 fails in the first attempt on purpose" in output, output
    assert "[keras_dist rank 0/2] ending this rank: rank 1 (host" in output, output
    for rank in range(2):
        assert f"SELF rank={rank} size=2 local={rank}/2 cross=0/1 attempt=1 ok" in output, output
    assert not processes_with_env(TAG_ENV, env[TAG_ENV])


@pytest.mark.timeout(120)
def test_torchruns_restarts_resume_an_elastic_job_from_its_last_commit(tmp_path):
    """Under torchrun --max-restarts with a run id, kd.elastic.run's commits
    carry the job over a restart, as under kdrun's elastic mode."""
    torchrun = _torchrun()
    env = job_environment({**QUIET, "KD_KILL_RANK": "1", "KD_KILL_STEP": "6",
                           "KERAS_DIST_ELASTIC_DIR": str(tmp_path / "commits")}, None)
    done = subprocess.run([torchrun, "--nproc-per-node", "2", "--max-restarts", "1",
                           "--rdzv-id", f"kdtest{os.getpid()}", "--master-port", str(free_port()),
                           str(REPO_ROOT / "tests" / "elastic" / "object_worker.py"),
                           str(tmp_path), "10"],
                          capture_output=True, text=True, env=env, timeout=100,
                          cwd=str(REPO_ROOT))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    logs = {path.name: json.loads(path.read_text()) for path in tmp_path.glob("launch*.json")}
    assert sorted(logs) == ["launch1.rank0.json", "launch1.rank1.json"], output
    reference = sum(np.sin(np.arange(4) + step) * 1.5 for step in range(10))
    for log in logs.values():
        # The second launch started from the commit of step 6, not from 0.
        assert log["start"] == 6 and log["steps"] == [7, 8, 9, 10], log
        np.testing.assert_allclose(log["weights"], reference, rtol=1e-12)
    assert not processes_with_env(TAG_ENV, env[TAG_ENV])


@pytest.mark.timeout(60)
def test_a_job_of_one_needs_no_rendezvous():
    # A port nothing listens on and that nobody may bind: a job of one never touches it.
    result = run_self_started([sys.executable, SELF, "report"], np=1, timeout=50, env=QUIET,
                              variables=lambda rank: {**torchrun_variables(1, 1)(0),
                                                      "MASTER_ADDR": "unreachable.invalid"})
    result.check()
    assert "SELF rank=0 size=1 local=0/1 cross=0/1 attempt=- ok" in result.output(0)
