"""keras_dist.spark.run on a real Spark cluster.

The cluster is Spark's ``local-cluster[2,1,1024]``: a master and two workers
in the driver's JVM, each worker running one executor JVM of its own (one
core, so one task slot each) with its own Python workers, as on two machines.
It needs PySpark and Java; without them those tests are skipped, saying why.
One cluster serves the module; when it is stopped, no process that carried
its tag (JVMs, Python workers, the ranks' processes) may be left.

The functions the ranks run are defined here and travel by value
(``cloudpickle.register_pickle_by_value``): the executors cannot import
this test module.
"""

import dataclasses
import glob
import io
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile

import numpy as np
import pytest

from keras_dist._runtime import procfs
from keras_dist.errors import KerasDistError, PeerFailureError
from keras_dist.launcher.cleanup import find_job_processes, kill_processes_with_env
from keras_dist.spark import run
from tests._mp import REPO_ROOT, TF_ONLY_HIDDEN

try:
    import pyspark
    from pyspark import cloudpickle
except ImportError:
    pyspark = None
else:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: Every process of the module's cluster carries this variable (its value the cluster's tag).
SPARK_CLUSTER_TAG = "KERAS_DIST_SPARK_TEST_CLUSTER"
#: Every process of one run() carries this variable (its value the run's tag).
SPARK_JOB_TAG = "KERAS_DIST_SPARK_TEST_JOB"
#: Each rank on one core, as the executors have.
SPARK_RANK_ENV = {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
                  "TF_NUM_INTEROP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}


def _spark_missing() -> str | None:
    if pyspark is None:
        return "PySpark is not installed (pip install pyspark)"
    if shutil.which("java") is None:
        return "Spark needs Java, and there is no java on PATH"
    return None


def _left_after(name: str, value: str, timeout: float) -> list[str]:
    """``"pid cmdline"`` of processes carrying ``name=value`` still alive after
    ``timeout`` seconds (then SIGKILLed, so that one failure does not leak into
    the next test)."""
    deadline = time.monotonic() + timeout
    while (pids := find_job_processes(name, value)) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                command = file.read().replace(b"\0", b" ").decode(errors="replace")
            left.append(f"{pid} {command.strip()}")
        except OSError:
            pass
    if left:
        kill_processes_with_env(name, value)
    return left


def _stop_spark(session) -> None:
    """Stops the session and the driver's JVM (which PySpark keeps for the next session)."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    session.stop()
    if gateway is None:
        return
    gateway.shutdown()
    process = getattr(gateway, "proc", None)
    if process is not None:
        process.stdin.close()  # the JVM ends when its stdin closes
        process.wait(timeout=60)
    SparkContext._gateway = None
    SparkContext._jvm = None


def _spark_home(directory):
    """A SPARK_HOME of the cluster's own: PySpark's files, linked. The
    executors write their logs under SPARK_HOME/work, here rather than into
    the installed package."""
    installed = os.path.dirname(pyspark.__file__)
    for name in os.listdir(installed):
        if name != "work":
            os.symlink(os.path.join(installed, name), directory / name)
    return directory


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory):
    reason = _spark_missing()
    if reason:
        print(f"skipping the Spark cluster tests: {reason}")
        pytest.skip(reason)
    from pyspark.sql import SparkSession

    tag = secrets.token_hex(8)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SPARK_CLUSTER_TAG, tag)  # the JVMs and Python workers inherit it
        patch.setenv("PYSPARK_PYTHON", sys.executable)
        patch.setenv("SPARK_HOME", str(_spark_home(tmp_path_factory.mktemp("spark_home"))))
        session = (SparkSession.builder.master("local-cluster[2,1,1024]")
                   .appName("keras_dist spark tests")
                   .config("spark.ui.enabled", "false")
                   .config("spark.ui.showConsoleProgress", "false")
                   .config("spark.pyspark.python", sys.executable)
                   # A barrier stage wider than the cluster fails after 2 checks, 1 s apart.
                   .config("spark.scheduler.barrier.maxConcurrentTasksCheck.interval", "1s")
                   .config("spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures", "2")
                   .getOrCreate())
        try:
            session.sparkContext.setLogLevel("ERROR")
            yield session
        finally:
            _stop_spark(session)
    left = _left_after(SPARK_CLUSTER_TAG, tag, timeout=60)
    assert not left, f"processes of the Spark cluster left after it stopped: {left}"


def _task_directories() -> set[str]:
    """The directories the executors' tasks keep their rank's files in (this
    machine's temporary directory, as the executors see it)."""
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "keras_dist_spark_*")))


@dataclasses.dataclass
class _Job:
    tag: str
    directories_before: set[str]


def _run_job(fn, **options):
    """``run(fn, ...)`` with a tag in its processes; returns (result or error, job)."""
    job = _Job(secrets.token_hex(6), _task_directories())
    env = {**SPARK_RANK_ENV, **options.pop("env", {}), SPARK_JOB_TAG: job.tag}
    try:
        return run(fn, env=env, **options), job
    except KerasDistError as error:
        return error, job


def _assert_no_job_processes(job: _Job) -> None:
    """No process of the run is left, nor a directory of its tasks."""
    left = _left_after(SPARK_JOB_TAG, job.tag, timeout=20)
    assert not left, f"processes of the run left after run() returned: {left}"
    directories = _task_directories() - job.directories_before
    assert not directories, f"task directories left after run() returned: {directories}"


def _mapped_shm() -> list[str]:
    """The /dev/shm files this process maps."""
    return sorted(procfs.mapped_files(os.getpid(), "/dev/shm/"))


# -- what the ranks run -------------------------------------------------------------------

def _allreduce_on_each_rank(seed, count, names, shipped):
    """Allreduces against numpy, what this rank's environment holds of ``names``,
    and the value of the module ``shipped`` (a zip Spark ships): one run, three tests."""
    import importlib

    import keras_dist as kd

    kd.init()
    rank = kd.rank()
    data = np.random.default_rng([seed, rank]).standard_normal(count)
    print(f"rank {rank} of {kd.size()} reduces {count} numbers", flush=True)
    return {"rank": rank, "size": kd.size(), "local_rank": kd.local_rank(),
            "LOCAL_RANK": os.environ["LOCAL_RANK"],
            "sum64": kd.allreduce(data, op=kd.Sum),
            "max64": kd.allreduce(data, op=kd.Max),
            "average32": kd.allreduce(data.astype(np.float32), op=kd.Average),
            "variables": {name: os.environ.get(name) for name in names},
            "shipped": importlib.import_module(shipped).VALUE}


def _train_mnist_example(script, data, checkpoint_dir):
    import runpy

    main = runpy.run_path(script)["main"]
    return main(["--epochs", "1", "--data", data, "--checkpoint-dir", checkpoint_dir])


def _killed_on_rank_1(report_dir):
    import keras_dist as kd

    kd.init()
    kd.allreduce(np.ones(1024, np.float32), op=kd.Sum)
    with open(os.path.join(report_dir, f"rank{kd.rank()}.shm"), "w") as file:
        file.write("\n".join(_mapped_shm()))
    kd.barrier()  # both ranks have said which segments they map
    if kd.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    kd.barrier()  # rank 0 waits here for rank 1, in vain
    return kd.rank()


def _raises_on_rank_1(when):
    import keras_dist as kd

    rank = int(os.environ["RANK"])
    if when == "before_init" and rank == 1:
        raise ValueError("injected on rank 1 before init")
    kd.init()  # before_init: rank 0 waits here for rank 1, in vain
    kd.barrier()
    if rank == 1:
        raise ValueError("injected on rank 1 after init")
    kd.barrier()
    return rank


def _trivial():
    import keras_dist as kd

    kd.init()
    return kd.rank()


# -- on the cluster -----------------------------------------------------------------------

SEED, COUNT = 20261206, 1000
VARIABLES = ["KERAS_DIST_RENDEZVOUS_TIMEOUT", "SPARK_TEST_VALUE", "RANK", "WORLD_SIZE",
             "MASTER_PORT"]


@dataclasses.dataclass
class _Run:
    results: object
    job: _Job
    stdout: io.StringIO
    stderr: io.StringIO


@pytest.fixture(scope="module")
def one_run(spark_cluster, tmp_path_factory):
    """One run() of _allreduce_on_each_rank, which three tests check: its
    allreduces, the variables each rank gets, a module Spark ships."""
    # A zip: Spark puts it on the task's sys.path (a file in the executor's
    # directory alone would not make its modules importable).
    name = f"keras_dist_spark_shipped_{secrets.token_hex(4)}"
    archive = tmp_path_factory.mktemp("shipped") / f"{name}.zip"
    with zipfile.ZipFile(archive, "w") as files:
        files.writestr(f"{name}.py", "VALUE = 'shipped by addPyFile'\n")
    spark_cluster.sparkContext.addPyFile(str(archive))
    out, err = io.StringIO(), io.StringIO()
    # num_proc defaults to the cluster's parallelism: its 2 slots.
    results, job = _run_job(_allreduce_on_each_rank, args=(SEED, COUNT, VARIABLES, name),
                            stdout=out, stderr=err, start_timeout=45,
                            env={"SPARK_TEST_VALUE": "from env="})
    return _Run(results, job, out, err)


@pytest.mark.timeout(150)
def test_allreduce_of_two_executors_matches_numpy(one_run):
    results = one_run.results
    assert not isinstance(results, Exception), results
    _assert_no_job_processes(one_run.job)
    data = [np.random.default_rng([SEED, rank]).standard_normal(COUNT) for rank in range(2)]
    expected_sum = np.sum(data, axis=0, dtype=np.float64)
    expected_max = np.max(data, axis=0)
    expected_average32 = np.mean([d.astype(np.float32) for d in data], axis=0, dtype=np.float64)
    assert [result["rank"] for result in results] == [0, 1]
    for rank, result in enumerate(results):
        assert result["size"] == 2
        # Both executors are on this machine: local ranks 0 and 1, as LOCAL_RANK said.
        assert result["local_rank"] == rank and result["LOCAL_RANK"] == str(rank)
        assert result["sum64"].dtype == np.float64 and result["average32"].dtype == np.float32
        np.testing.assert_allclose(result["sum64"], expected_sum, rtol=1e-15, atol=0)
        np.testing.assert_array_equal(result["max64"], expected_max)
        np.testing.assert_allclose(result["average32"], expected_average32, rtol=1e-6, atol=1e-7)
    # Each rank's stdout reached the driver, labelled; verbose=1 said where each started.
    for rank in range(2):
        assert f"[{rank}] rank {rank} of 2 reduces {COUNT} numbers" in one_run.stdout.getvalue()
        assert f"keras_dist.spark: rank {rank} of 2 started: pid " in one_run.stderr.getvalue()


@pytest.mark.timeout(60)
def test_results_in_rank_order_and_the_variables_each_rank_gets(one_run):
    results = one_run.results
    assert not isinstance(results, Exception), results
    assert [result["rank"] for result in results] == [0, 1]
    for rank, result in enumerate(results):
        variables = result["variables"]
        assert variables["KERAS_DIST_RENDEZVOUS_TIMEOUT"] == "45"
        assert variables["SPARK_TEST_VALUE"] == "from env="
        assert (variables["RANK"], variables["WORLD_SIZE"]) == (str(rank), "2")
    assert results[0]["variables"]["MASTER_PORT"] == results[1]["variables"]["MASTER_PORT"]


@pytest.mark.timeout(60)
def test_a_module_spark_ships_imports_in_the_ranks(one_run):
    results = one_run.results
    assert not isinstance(results, Exception), results
    assert [result["shipped"] for result in results] == ["shipped by addPyFile"] * 2, results


@pytest.mark.timeout(200)
def test_mnist_example_trains_to_identical_weights(spark_cluster, tmp_path):
    script = REPO_ROOT / "examples" / "mnist" / "train.py"
    data = REPO_ROOT / "examples" / "mnist" / "mnist_5k.npz"
    # As tests/_mp.py runs TensorFlow jobs: JAX and matplotlib hidden (1.4 s of start-up).
    hide = {"PYTHONPATH": str(REPO_ROOT / "tests" / "_tf_only"),
            "KERAS_DIST_TEST_HIDE": ",".join(TF_ONLY_HIDDEN), "KERAS_BACKEND": "tensorflow"}
    results, job = _run_job(_train_mnist_example, num_proc=2, verbose=0, env=hide,
                            args=(str(script), str(data), str(tmp_path / "checkpoints")))
    assert not isinstance(results, Exception), results
    _assert_no_job_processes(job)
    (accuracy0, digest0), (accuracy1, digest1) = results
    assert digest0 == digest1, results
    # One epoch on the shipped 4,000 training digits: far above chance (0.1).
    assert accuracy0 == accuracy1 and accuracy0 > 0.8, results


@pytest.mark.timeout(120)
def test_killed_rank_ends_the_run_naming_it(spark_cluster, tmp_path):
    started = time.monotonic()
    error, job = _run_job(_killed_on_rank_1, num_proc=2, args=(str(tmp_path),), verbose=0)
    print(f"run() raised {time.monotonic() - started:.1f} s after it was called")
    assert isinstance(error, PeerFailureError), error
    # The job's process manager saw rank 1 go first.
    assert error.peer_rank == 1, error
    assert "rank 1 of 2 failed first (killed by SIGKILL)" in str(error), error
    assert "rank 1 of 2 (pid " in str(error) and "): killed by SIGKILL" in str(error), error
    assert error.__cause__ is None, repr(error.__cause__)
    _assert_no_job_processes(job)
    mapped = {name for rank in range(2)
              for name in (tmp_path / f"rank{rank}.shm").read_text().split()}
    assert any(name.startswith(("mpich_shm_", "keras_dist")) for name in mapped), mapped
    left = sorted(name for name in mapped if os.path.exists(os.path.join("/dev/shm", name)))
    assert left == [], f"/dev/shm files of the run left behind: {left}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["after_init", "before_init"])
def test_exception_on_one_rank_propagates_naming_it(spark_cluster, when):
    error, job = _run_job(_raises_on_rank_1, num_proc=2, args=(when,), verbose=0)
    assert isinstance(error, PeerFailureError), error
    assert error.peer_rank == 1, error
    message = f"injected on rank 1 {when.replace('_', ' ')}"
    text = str(error)
    assert f"rank 1 of 2 failed first (fn raised ValueError: {message})" in text, text
    assert "rank 1 of 2 (pid " in text and f"): fn raised ValueError: {message}" in text, text
    # The traceback starts at fn, in this file.
    assert "_raises_on_rank_1" in text and "test_spark.py" in text, text
    assert isinstance(error.__cause__, ValueError), repr(error.__cause__)
    assert str(error.__cause__) == message
    _assert_no_job_processes(job)


@pytest.mark.timeout(60)
def test_more_ranks_than_task_slots_fails_with_sparks_reason(spark_cluster):
    error, job = _run_job(_trivial, num_proc=3, verbose=0)
    assert type(error) is KerasDistError, error
    assert "failed before any rank reported a failure" in str(error), error
    assert "BarrierJobSlotsNumberCheckFailed" in str(error), error


def test_arguments_out_of_range(spark_cluster):
    with pytest.raises(ValueError, match=r"`num_proc` must be a whole number >= 1. "
                                         r"Received: num_proc=0"):
        run(_trivial, num_proc=0)
    with pytest.raises(ValueError, match=r"Received: start_timeout=-1"):
        run(_trivial, num_proc=2, start_timeout=-1)


# -- without a cluster --------------------------------------------------------------------

def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=REPO_ROOT, env={**os.environ, **env})


@pytest.mark.timeout(60)
def test_import_leaves_spark_alone_and_run_says_how_to_install_it():
    imported = _python("import sys, keras_dist.spark; print('pyspark' in sys.modules)")
    assert imported.returncode == 0 and imported.stdout.strip() == "False", imported
    hidden = _python("import keras_dist.spark as s; s.run(print)",
                     PYTHONPATH=str(REPO_ROOT / "tests" / "_tf_only"),
                     KERAS_DIST_TEST_HIDE="pyspark")
    assert hidden.returncode == 1, hidden
    assert "ImportError: keras_dist.spark needs PySpark" in hidden.stderr, hidden.stderr
    assert "pip install 'pyspark>=3.5'" in hidden.stderr, hidden.stderr


@pytest.mark.timeout(60)
def test_run_without_a_session_says_so():
    if pyspark is None:
        pytest.skip("PySpark is not installed")
    result = _python("import keras_dist.spark as s; s.run(print)")
    assert result.returncode == 1, result
    assert "RuntimeError: keras_dist.spark.run needs an active SparkSession" in result.stderr, (
        result.stderr)
