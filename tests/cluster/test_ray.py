"""keras_dist.ray.RayExecutor on a real multi-node Ray cluster on this machine.

``ray.cluster_utils.Cluster`` starts a head node (no CPUs: nothing runs there
but Ray's own services) and two worker nodes of 3 (logical) CPUs, each a
raylet of its own (tests/cluster/ray_cluster.py). The module's shared
executor holds 3 of the 6 CPUs while other tests start executors of their own
beside it. Executors place their ranks with ``SPREAD`` (or one per node) so
that a job spans both nodes. The nodes share this machine, so keras_dist
finds one host and the ranks on different Ray nodes still meet in shared
memory (local ranks run over all of them); across machines MPI would carry
what the shm engine carries here.

Checked: collectives against numpy float64, the MNIST example trained through
the executor with the same weights on every rank, executables, a killed worker
and an exception on one rank each ending ``run()`` with an error naming that
rank, and nothing left behind (no worker, no rendezvous server, no MPICH
segment; the cluster's own processes gone at the end).
"""

from __future__ import annotations

import operator
import os
import secrets
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ray = pytest.importorskip(
    "ray", reason="Ray is not installed (pip install ray): keras_dist.ray "
                  "has nothing to run on")

from keras_dist.errors import KerasDistError, PeerFailureError  # noqa: E402
from keras_dist.launcher.cleanup import MPI_SHM_PREFIXES  # noqa: E402
from keras_dist.ray import RayExecutor  # noqa: E402
from tests._mp import REPO_ROOT, TAG_ENV, processes_with_env  # noqa: E402
from tests.cluster import ray_workers  # noqa: E402
from tests.cluster.ray_cluster import WORKER_ENV, start_local_cluster  # noqa: E402

#: /dev/shm files of the job: MPI's (MPICH, UCX) and keras_dist's own engine's.
JOB_SHM_PREFIXES = (*MPI_SHM_PREFIXES, "kd-")
#: How long a killed process may take to be gone from /proc (SIGKILL of a
#: process with a large memory is not instant).
SETTLE_SECONDS = 20.0


def _settled(find, seconds: float = SETTLE_SECONDS):
    """``find()`` once it returns nothing, or what it still returns after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        found = find()
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster():
    """A head node and two worker nodes. Every process of the cluster (Ray's
    services, the workers, their rendezvous servers) inherits a tag, so what
    is left after the cluster's shutdown is found and reported."""
    tag = secrets.token_hex(8)
    previous = os.environ.get(TAG_ENV)
    os.environ[TAG_ENV] = tag
    started = None
    try:
        started = start_local_cluster(worker_nodes=2, cpus_per_node=3)
        ray.init(address=started.address, runtime_env={"env_vars": WORKER_ENV})
        assert processes_with_env(TAG_ENV, tag), "Ray's processes do not carry the tag"
        yield started
    finally:
        ray.shutdown()
        if started is not None:
            started.shutdown()
        if previous is None:
            os.environ.pop(TAG_ENV, None)
        else:
            os.environ[TAG_ENV] = previous
        leftovers = _settled(lambda: processes_with_env(TAG_ENV, tag))
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        assert not leftovers, f"the Ray cluster left processes behind: {leftovers}"


def _gone(pids):
    """Of ``pids``, those still running once the settle time has passed."""
    def running():
        alive = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat", "rb") as handle:
                    state = handle.read().rsplit(b")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state not in (b"Z", b"X"):
                alive.append(pid)
        return alive
    return _settled(running)


def _job_traces(executor: RayExecutor):
    """Every process of the job (ranks and the process manager beside rank 0) and the
    /dev/shm files the ranks map, recorded by the ranks themselves."""
    described = executor.run(ray_workers.describe)
    server = ray.get(executor._process_manager.server_pid.remote(), timeout=60)
    pids = [rank["pid"] for rank in described] + [server]
    segments = sorted({name for rank in described for name in rank["shm"]
                       if name.startswith(JOB_SHM_PREFIXES)})
    # Not vacuous: the process manager beside rank 0 runs, MPICH maps its segment.
    with open(f"/proc/{server}/cmdline", "rb") as handle:
        assert b"pmi_server.py" in handle.read(), f"pid {server} is not the process manager"
    assert any(name.startswith("mpich_shm_") for name in segments), segments
    return described, pids, segments


def _assert_nothing_left(pids, segments):
    running = _gone(pids)
    assert not running, f"processes of the job still run: {running}"
    left = _settled(lambda: [name for name in segments if os.path.exists(f"/dev/shm/{name}")])
    assert not left, f"shared-memory files of the job were left in /dev/shm: {left}"


@pytest.fixture(scope="module")
def executor(cluster):
    """Three ranks, spread over both worker nodes."""
    started = RayExecutor(num_workers=3, placement_strategy="SPREAD")
    started.start()
    described, pids, segments = _job_traces(started)
    try:
        yield started
    finally:
        started.shutdown()
    _assert_nothing_left(pids, segments)
    assert {rank["host"] for rank in described} == {described[0]["host"]}


@pytest.mark.timeout(120)
def test_run_allreduces_like_numpy_float64_across_ray_nodes(executor):
    seed = 20240611
    results = executor.run(ray_workers.allreduce_random, args=(seed,))
    assert [result["rank"] for result in results] == [0, 1, 2]
    assert {result["size"] for result in results} == {3}
    # One machine: keras_dist numbers local ranks over all three, on both Ray nodes.
    assert [result["local_rank"] for result in results] == [0, 1, 2]
    assert len({result["node_id"] for result in results}) == 2, results
    inputs = [ray_workers.rank_data(seed, rank) for rank in range(3)]
    for case, (_, _, dtype) in enumerate(ray_workers.ALLREDUCE_CASES):
        stacked = np.stack([inputs[rank][case].astype(np.float64) for rank in range(3)])
        tolerance = 1e-5 if dtype == "float32" else 1e-12
        for result in results:
            for op, reference in (("sum", stacked.sum(0)), ("average", stacked.mean(0)),
                                  ("max", stacked.max(0))):
                got = result[op][case]
                assert got.dtype == np.dtype(dtype), (op, case, got.dtype)
                np.testing.assert_allclose(got, reference, rtol=tolerance, atol=tolerance,
                                           err_msg=f"{op} case {case} rank {result['rank']}")


@pytest.mark.timeout(120)
def test_the_executor_is_horovods(executor):
    assert executor.run(ray_workers.combine, args=(2, 3), kwargs={"scale": 10}) == [
        (0, 50), (1, 50), (2, 50)]
    assert executor.run(ray_workers.combine, args=(2, 3)) == [(0, 5), (1, 5), (2, 5)]
    refs = executor.run_remote(ray_workers.combine, args=(4,), kwargs={"b": 1})
    assert ray.get(refs) == [(0, 5), (1, 5), (2, 5)]
    assert len(executor.workers) == 3


@pytest.mark.timeout(120)
def test_execute_calls_fn_with_each_ranks_executable(cluster):
    # Horovod's other placement: one bundle per machine (STRICT_SPREAD).
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=120), num_hosts=2,
                           num_workers_per_host=1)
    executor.start(executable_cls=ray_workers.Counter, executable_args=(10,),
                   executable_kwargs={"step": 5})
    try:
        described = executor.run(ray_workers.describe)
        assert len({rank["node_id"] for rank in described}) == 2, described
        assert executor.execute(operator.methodcaller("bump")) == [(0, 15), (1, 15)]
        assert executor.execute(operator.methodcaller("bump")) == [(0, 20), (1, 20)]
        assert executor.execute_single(operator.methodcaller("bump")) == (0, 25)
        assert executor.execute(operator.attrgetter("value")) == [25, 20]
    finally:
        executor.shutdown()
    with pytest.raises(KerasDistError, match=r"not running \(shut down\): call start\(\)"):
        executor.run(operator.add, args=(1, 1))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_mnist_example_trains_to_the_same_weights_on_every_rank(executor, tmp_path):
    argv = ["--epochs", "1", "--data", str(ray_workers.MNIST_SUBSET),
            "--checkpoint-dir", str(tmp_path), "--threads", "1"]
    results = executor.run(ray_workers.train_mnist_example, args=(argv,))
    accuracies = [accuracy for accuracy, _ in results]
    digests = [digest for _, digest in results]
    assert len(set(digests)) == 1, f"the ranks' final weights differ: {digests}"
    # One epoch on 4,000 real digits: far above chance (0.1); the same on every rank.
    assert len(set(accuracies)) == 1 and accuracies[0] > 0.8, accuracies
    assert (tmp_path / "checkpoint-1.keras").is_file()


def _failing_job(executor: RayExecutor, fn):
    """Starts a job and runs ``fn``, which fails on rank 1: the error, and the
    job's processes and segments (for the check that nothing is left)."""
    executor.start()
    _, pids, segments = _job_traces(executor)
    try:
        with pytest.raises(PeerFailureError) as raised:
            executor.run(fn, args=(1,))
    finally:
        executor.shutdown()
    return raised, pids, segments


@pytest.mark.timeout(120)
def test_a_killed_worker_ends_run_naming_its_rank_and_start_makes_a_new_job(cluster):
    executor = RayExecutor(num_workers=3, placement_strategy="SPREAD")
    raised, pids, segments = _failing_job(executor, ray_workers.die_on_rank)
    assert raised.value.peer_rank == 1, str(raised.value)
    assert str(raised.value).startswith("rank 1 of 3 failed during run(): rank 1 (host "), \
        str(raised.value)
    _assert_nothing_left(pids, segments)
    with pytest.raises(KerasDistError, match=r"not running \(rank 1 failed in run\(\)\)"):
        executor.run(ray_workers.combine, args=(1, 1))
    # The same executor starts a new job on new workers (a restart resumes from here).
    executor.start()
    try:
        assert executor.run(ray_workers.combine, args=(1, 1)) == [(0, 2), (1, 2), (2, 2)]
        _, new_pids, _ = _job_traces(executor)
    finally:
        executor.shutdown()
    assert not set(new_pids) & set(pids)


@pytest.mark.timeout(120)
def test_an_exception_on_one_rank_ends_run_naming_its_rank(cluster):
    executor = RayExecutor(num_workers=2, placement_strategy="SPREAD")
    raised, pids, segments = _failing_job(executor, ray_workers.raise_on_rank)
    assert raised.value.peer_rank == 1
    assert str(raised.value).startswith(
        "rank 1 of 2 raised Boom in run(): boom on rank 1"), str(raised.value)
    # The rank's own error is the cause, still of the user's class.
    assert isinstance(raised.value.__cause__, ray_workers.Boom)
    _assert_nothing_left(pids, segments)


@pytest.mark.timeout(60)
def test_placement_that_cannot_be_met_fails_start_and_releases_everything(cluster):
    executor = RayExecutor(RayExecutor.create_settings(placement_group_timeout_s=2),
                           num_workers=50)  # the cluster has 6 CPUs
    with pytest.raises(KerasDistError, match=r"could not reserve 50 bundle\(s\) of \{'CPU': 1\}"):
        executor.start()
    # The group is removed (not left pending, holding the cluster's CPUs).
    still = _settled(lambda: [entry["state"] for entry in
                              ray.util.placement_group_table().values()
                              if len(entry["bundles"]) == 50 and entry["state"] != "REMOVED"])
    assert not still, still


@pytest.mark.parametrize("kwargs, message", [
    ({}, "Give `num_workers`, or `num_hosts`"),
    ({"num_workers": 0}, "`num_workers` must be a whole number >= 1. Received: num_workers=0"),
    ({"num_workers": 2, "num_workers_per_host": 2}, "`num_workers_per_host` goes with"),
    ({"num_hosts": 2, "num_workers_per_host": 0},
     "`num_workers_per_host` must be a whole number >= 1. Received: num_workers_per_host=0"),
    ({"num_workers": 2, "placement_strategy": "pack"}, "`placement_strategy` must be one of"),
    ({"num_workers": 2, "gpus_per_worker": 1}, "`gpus_per_worker` needs `use_gpu=True`"),
    ({"num_workers": 2, "settings": {"timeout_s": 1}}, "`settings` must come from"),
])
def test_arguments_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[")):
        RayExecutor(**kwargs)


def test_importing_keras_dist_leaves_ray_alone_and_a_missing_ray_says_what_to_install():
    code = ("import sys, keras_dist; assert 'ray' not in sys.modules, 'keras_dist imported ray'\n"
            "sys.modules['ray'] = None\n"
            "try:\n    import keras_dist.ray\nexcept ImportError as error:\n    print(error)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stderr
    assert "pip install 'ray>=2.9'" in done.stdout, done.stdout
