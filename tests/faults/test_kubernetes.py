"""Kubernetes, simulated: the manifests of examples/kubernetes/ as their pods
would run them.

The two "hosts" of test_multihost.py (network namespaces with hostnames of
their own, joined by a bridge) are the pods. Each gets what Kubernetes and
the controllers give a pod: its hostname, the DNS names of its peers (an
``/etc/hosts`` bound over the real one in the pod's mount namespace), and the
environment and files of its container:

- an MPIJob (Kubeflow MPI Operator, ``mpiImplementation: MPICH``): ``kdrun``
  with no host flags in the launcher, which has the operator's
  ``HYDRA_HOST_FILE`` and ``/etc/mpi/hostfile``; hydra reaches the workers
  through ``k8s_ssh.sh`` in place of ssh;
- an indexed Job: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``;
- a Kubeflow TrainJob (``torch-distributed`` runtime): ``PET_*``, read by
  the process itself (``numProcPerNode: 1``) or by ``torchrun`` (2).

UCX is kept to TCP, as in test_multihost.py: processes of two "pods" share
one kernel here. Needs root, ``ip`` and ``unshare``; skipped otherwise.
"""

import dataclasses
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from keras_dist._runtime import procfs
from keras_dist.launcher.cleanup import kill_processes_with_env
from tests._mp import REPO_ROOT, TAG_ENV, RunningJob, job_environment, processes_with_env
from tests.faults import test_multihost

HERE = Path(__file__).parent
WORKER = str(HERE / "k8s_worker.py")
SSH = str(HERE / "k8s_ssh.sh")
EXAMPLES = REPO_ROOT / "examples" / "kubernetes"
MNIST = REPO_ROOT / "examples" / "mnist"

#: The fixture of the two "hosts" (network namespaces) that stand for the pods.
hosts = test_multihost.hosts
# The tests that build network namespaces (the manifests' test needs none).
netns = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None
                           or shutil.which("unshare") is None, reason="needs root, ip and unshare")

# What the manifests say (test_the_manifests_say_what_these_tests_run checks them).
MPIJOB, INDEXED_JOB, TRAINJOB = "mnist-mpi", "mnist-job", "mnist-train"
NAMESPACE = "default"
SLOTS_PER_WORKER = 2
PORT = 29500

# Variables of the test machine, not of Kubernetes: MPI crosses the bridge.
NETWORK = ("UCX_TLS", "UCX_NET_DEVICES", "FI_PROVIDER")
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1",
         "KERAS_DIST_RENDEZVOUS_TIMEOUT": "60", "KERAS_DIST_TIMEOUT_SECONDS": "60"}
# Shared-memory files of MPICH and of keras_dist's engine.
SHM_PREFIXES = ("mpich_", "kd-")

# A pod's container: its peers' names in /etc/hosts, its hostname, then the command.
POD = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'


#: Where examples/kubernetes/indexed-job.yaml mounts the job's Secret.
SECRET_MOUNT = "/etc/keras-dist/secret"
#: The job's secret in these tests (a Kubernetes Secret's value).
SECRET = secrets.token_hex(32)


def indexed_job_variables(index: int, secret_file: str = SECRET_MOUNT) -> dict[str, str]:
    """The variables examples/kubernetes/indexed-job.yaml gives pod ``index``
    (``JOB_COMPLETION_INDEX`` from the Job controller); in the tests the
    Secret's file is ``secret_file``."""
    return {"RANK": str(index), "WORLD_SIZE": "2", "MASTER_ADDR": f"{INDEXED_JOB}-0.{INDEXED_JOB}",
            "MASTER_PORT": str(PORT), "KERAS_DIST_SECRET_FILE": secret_file,
            "JOB_COMPLETION_INDEX": str(index)}


def trainjob_variables(index: int, per_node: int) -> dict[str, str]:
    """What Kubeflow Trainer's torch plugin gives node ``index`` of a TrainJob of
    2 nodes, ``numProcPerNode: per_node`` (examples/kubernetes/trainjob.yaml),
    with the Secret's value as ``KERAS_DIST_SECRET``."""
    return {"PET_NNODES": "2", "PET_NPROC_PER_NODE": str(per_node), "PET_NODE_RANK": str(index),
            "PET_MASTER_ADDR": f"{TRAINJOB}-node-0-0.{TRAINJOB}", "PET_MASTER_PORT": str(PORT),
            "KERAS_DIST_SECRET": SECRET, "JOB_COMPLETION_INDEX": str(index)}


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory) -> str:
    """The job's Secret as a pod sees it mounted (with the newline ``echo`` leaves)."""
    path = tmp_path_factory.mktemp("secret") / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o400)
    return str(path)


def operator_hostfile(workers: int) -> str:
    """/etc/mpi/hostfile as the MPI Operator writes it for MPICH (no cluster domain)."""
    return "".join(f"{MPIJOB}-worker-{index}.{MPIJOB}.{NAMESPACE}.svc:{SLOTS_PER_WORKER}\n"
                   for index in range(workers))


def _hosts_file(directory: str, names: dict[str, str]) -> str:
    """An /etc/hosts giving each name (FQDNs and short ones) its address."""
    path = os.path.join(directory, "hosts")
    with open(path, "w") as handle:
        handle.write("127.0.0.1 localhost\n")
        for name, address in names.items():
            handle.write(f"{address} {name}\n")
    return path


class JobSegments(threading.Thread):
    """The shared-memory files (MPICH's, keras_dist's) that the processes carrying
    ``tag`` map, looked at every 0.1 s while they run; ``left()`` says which are
    still in /dev/shm. Other jobs on this machine share /dev/shm: their files
    are not this job's."""

    def __init__(self, tag: str) -> None:
        super().__init__(daemon=True)
        self.tag, self.names, self.done = tag, set(), threading.Event()
        self.start()

    def run(self) -> None:
        while not self.done.wait(0.1):
            for pid in processes_with_env(TAG_ENV, self.tag):
                self.names |= {name for name in procfs.mapped_files(pid, "/dev/shm/")
                               if name.startswith(SHM_PREFIXES)}

    def wait_for(self, prefixes: tuple[str, ...], timeout: float) -> bool:
        """Waits until a file of each prefix has been seen mapped."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(any(name.startswith(prefix) for name in set(self.names))
                   for prefix in prefixes):
                return True
            time.sleep(0.05)
        return False

    def left(self) -> list[str]:
        self.done.set()
        self.join()
        return sorted(name for name in self.names if os.path.exists(f"/dev/shm/{name}"))


def _reports(text: str) -> dict[int, dict]:
    reports = [json.loads(line.partition("REPORT ")[2]) for line in text.splitlines()
               if "REPORT {" in line]
    return {report["rank"]: report for report in reports}


@dataclasses.dataclass(frozen=True)
class Pod:
    """A process as a pod's container starts it: in the network namespace of a
    "host", under the pod's hostname, with the container's variables."""

    namespace: str
    address: str
    hostname: str
    #: The name the pod's peers know it by (``<hostname>.<service>``).
    dns_name: str
    command: tuple[str, ...]
    variables: dict[str, str]


@dataclasses.dataclass
class Outcome:
    """How the processes of some pods ended."""

    codes: list[int]
    timed_out: bool
    #: CLOCK_MONOTONIC when the last process had ended.
    ended: float
    #: Pids of the job's processes still running then (rank 0's rendezvous server too).
    leftovers: list[int]
    #: The job's shared-memory files still in /dev/shm, and all it mapped.
    shm_left: list[str]
    shm_seen: list[str]
    outputs: list[str]

    def describe(self) -> str:
        parts = [f"exit codes {self.codes}, timed out: {self.timed_out}, left running: "
                 f"{self.leftovers}, left in /dev/shm: {self.shm_left} (of {self.shm_seen})\n"]
        for index, text in enumerate(self.outputs):
            parts.append(f"----- process {index}:\n{text[-6000:]}\n")
        return "".join(parts)


class Pods:
    """Processes started as pods' containers start them, with a hard timeout;
    each one's output (stdout and stderr) kept, and whatever they leave found."""

    def __init__(self, pods: list[Pod], env: dict[str, str]) -> None:
        self.scratch = tempfile.TemporaryDirectory(prefix="kdk8s-")
        hosts_file = _hosts_file(self.scratch.name, {pod.dns_name: pod.address for pod in pods})
        env = job_environment({**QUIET, **env}, None)
        self.tag = env[TAG_ENV]
        self.started = time.monotonic()
        self.procs, self.paths = [], []
        for index, pod in enumerate(pods):
            self.paths.append(os.path.join(self.scratch.name, f"process{index}"))
            with open(self.paths[-1], "wb") as output:
                self.procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", pod.namespace, "unshare", "--uts", "sh", "-c", POD,
                     "sh", hosts_file, pod.hostname, *pod.command],
                    env={**env, **pod.variables}, stdin=subprocess.DEVNULL, stdout=output,
                    stderr=subprocess.STDOUT, cwd=str(REPO_ROOT), start_new_session=True))
        self.segments = JobSegments(self.tag)

    def output(self, index: int) -> str:
        return Path(self.paths[index]).read_bytes().decode(errors="replace")

    def wait(self, timeout: float) -> Outcome:
        """Waits for every process; kills all of the job's past ``timeout`` (from the start)."""
        deadline = self.started + timeout
        timed_out = False
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        ended = time.monotonic()
        # Rank 0's rendezvous server ends within a second of the last rank.
        while processes_with_env(TAG_ENV, self.tag) and time.monotonic() < ended + 5:
            time.sleep(0.05)
        leftovers = processes_with_env(TAG_ENV, self.tag)
        kill_processes_with_env(TAG_ENV, self.tag)
        try:
            return Outcome(
                codes=[proc.wait() for proc in self.procs], timed_out=timed_out, ended=ended,
                leftovers=leftovers, shm_left=self.segments.left(),
                shm_seen=sorted(self.segments.names),
                outputs=[self.output(index) for index in range(len(self.procs))])
        finally:
            self.scratch.cleanup()


def _network(env: dict[str, str]) -> dict[str, str]:
    return {name: env[name] for name in NETWORK}


# --- the manifests ----------------------------------------------------------------


def _manifests(name: str) -> list[dict]:
    yaml = pytest.importorskip("yaml")
    return list(yaml.safe_load_all((EXAMPLES / name).read_text()))


def _container_env(container: dict, index: int) -> dict[str, str]:
    """A container's env as the kubelet resolves it in the pod of completion index ``index``."""
    values = {}
    for item in container.get("env", []):
        if "value" in item:  # $(NAME) expands to an earlier entry, as the kubelet does it
            values[item["name"]] = re.sub(r"\$\((\w+)\)",
                                          lambda m: values.get(m[1], m[0]), item["value"])
        else:
            path = item["valueFrom"]["fieldRef"]["fieldPath"]
            assert path == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
            values[item["name"]] = str(index)
    return values


def test_the_indexed_job_manifest_gives_what_its_test_runs():
    service, job = _manifests("indexed-job.yaml")
    assert service["metadata"]["name"] == INDEXED_JOB and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": INDEXED_JOB}
    assert job["metadata"]["name"] == INDEXED_JOB
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == INDEXED_JOB
    (volume,) = pod["volumes"]
    assert volume["secret"]["secretName"] and volume["secret"]["defaultMode"] == 0o400
    (mount,) = pod["containers"][0]["volumeMounts"]
    assert mount["name"] == volume["name"] and mount["readOnly"]
    assert SECRET_MOUNT == f"{mount['mountPath']}/secret"
    assert pod["containers"][0]["command"][:2] == ["python", "/app/mnist/train.py"]
    for index in range(2):
        expected = indexed_job_variables(index)
        del expected["JOB_COMPLETION_INDEX"]  # the Job controller adds it
        assert _container_env(pod["containers"][0], index) == expected


def test_the_trainjob_manifest_gives_what_its_test_runs():
    (trainjob,) = _manifests("trainjob.yaml")
    assert trainjob["metadata"]["name"] == TRAINJOB
    assert trainjob["spec"]["runtimeRef"]["name"] == "torch-distributed"
    trainer = trainjob["spec"]["trainer"]
    # trainjob_variables(index, 1): Trainer derives PET_* from these.
    assert trainer["numNodes"] == 2 and trainer["numProcPerNode"] == 1
    assert trainer["command"][:2] == ["python", "/app/mnist/train.py"]
    (secret,) = trainer["env"]
    assert secret["name"] == "KERAS_DIST_SECRET"
    assert secret["valueFrom"]["secretKeyRef"]["key"] == "secret"


def test_the_mpijob_manifest_gives_what_its_test_runs():
    (mpijob,) = _manifests("mpijob.yaml")
    assert mpijob["apiVersion"] == "kubeflow.org/v2beta1" and mpijob["kind"] == "MPIJob"
    assert mpijob["metadata"]["name"] == MPIJOB
    spec = mpijob["spec"]
    assert spec["mpiImplementation"] == "MPICH" and spec["slotsPerWorker"] == SLOTS_PER_WORKER
    assert spec["mpiReplicaSpecs"]["Worker"]["replicas"] == 2
    launcher = spec["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    assert launcher["command"][:3] == ["kdrun", "python", "/app/mnist/train.py"]


def test_the_image_holds_the_example_where_the_manifests_run_it():
    assert "COPY examples/mnist /app/mnist\n" in (EXAMPLES / "Dockerfile").read_text()


# --- an MPIJob: kdrun in the launcher, with the operator's host file ----------------


@netns
@pytest.mark.timeout(120)
def test_mpijob_launcher_runs_kdrun_on_the_operators_hostfile(hosts):
    _, fixture_env, _, entries = hosts
    launcher = f"{MPIJOB}-launcher"
    workers = [f"{MPIJOB}-worker-{index}" for index in range(len(entries))]
    fqdns = [f"{worker}.{MPIJOB}.{NAMESPACE}.svc" for worker in workers]
    with tempfile.TemporaryDirectory(prefix="kdk8s-") as scratch:
        hostfile = os.path.join(scratch, "hostfile")  # the launcher's /etc/mpi/hostfile
        with open(hostfile, "w") as handle:
            handle.write(operator_hostfile(len(workers)))
        names = {fqdn: address for fqdn, (address, _, _) in zip(fqdns, entries)}
        hosts_file = _hosts_file(scratch, {launcher: fixture_env["KD_LAUNCH_ADDRESS"], **names})
        env = {
            **QUIET, **_network(fixture_env),
            # The operator's, in the launcher's container (mpiImplementation: MPICH).
            "K_MPI_JOB_ROLE": "launcher", "HYDRA_HOST_FILE": hostfile,
            "HYDRA_LAUNCH_EXTRA_ARGS": "-o ConnectionAttempts=10",
            # ssh to the worker pods: a network namespace each, under the pod's hostname.
            "HYDRA_LAUNCHER": "ssh", "HYDRA_LAUNCHER_EXEC": SSH,
            "KD_NETNS_HOSTS": ",".join(f"{fqdn}={entry[1]}={worker}"
                                       for fqdn, entry, worker in zip(fqdns, entries, workers)),
        }
        # The launcher pod (its hostname, its peers' names) runs `kdrun COMMAND`.
        job = RunningJob(["unshare", "--mount", "--uts", "sh", "-c", POD, "sh", hosts_file,
                          launcher, sys.executable, "-m", "keras_dist.run",
                          sys.executable, WORKER, "check"],
                         job_environment(env, None), str(REPO_ROOT), per_rank_output=False)
        segments = JobSegments(job.tag)
        result = job.wait(90)
    message = result.describe()
    assert result.returncode == 0 and not result.timed_out, message
    reports = _reports(result.launcher_stdout)
    assert sorted(reports) == [0, 1, 2, 3], message  # -np: the slots of the host file
    for rank, report in reports.items():
        assert report["size"] == 4, message
        assert report["hosts"] == [workers[0], workers[0], workers[1], workers[1]], message
        assert (report["local_rank"], report["local_size"]) == (rank % 2, 2), message
        assert (report["cross_rank"], report["cross_size"]) == (rank // 2, 2), message
        assert report["allreduce_error"] <= 1e-12 and report["agreed"], message
    assert result.leftovers == [] and segments.left() == [], message


# --- pods that start their processes themselves ---------------------------------------


def _pods(kind: str, entries, command: list[str], secret_file: str,
          per_pod: int = 1) -> list[Pod]:
    """The processes of a job of 2 pods, started as ``kind`` starts them."""
    pods = []
    for index, (address, namespace, _) in enumerate(entries):
        if kind == "indexed-job":
            hostname, service = f"{INDEXED_JOB}-{index}", INDEXED_JOB
            variables = [indexed_job_variables(index, secret_file)]
            if per_pod > 1:  # the pod's command starts its processes, numbered as torchrun does
                variables = [{**variables[0], "WORLD_SIZE": str(2 * per_pod),
                              "RANK": str(index * per_pod + local), "LOCAL_RANK": str(local)}
                             for local in range(per_pod)]
        else:  # a TrainJob: one process a pod, which `torchrun` may be
            hostname, service = f"{TRAINJOB}-node-0-{index}", TRAINJOB
            variables = [trainjob_variables(index, per_pod)]
        pods += [Pod(namespace, address, hostname, f"{hostname}.{service}", tuple(command), each)
                 for each in variables]
    return pods


@netns
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind, per_pod", [
    ("indexed-job", 1), ("trainjob", 1), ("trainjob-torchrun", 2)])
def test_pods_that_start_their_processes_form_one_job(hosts, secret_file, kind, per_pod):
    command = [sys.executable, WORKER, "check"]
    if kind == "trainjob-torchrun":  # `torchrun k8s_worker.py check`: torchrun reads PET_*
        pytest.importorskip("torch")
        command = [sys.executable, "-m", "torch.distributed.run", WORKER, "check"]
    _, fixture_env, _, entries = hosts
    pods = _pods(kind.partition("-torchrun")[0], entries, command, secret_file, per_pod)
    outcome = Pods(pods, _network(fixture_env)).wait(90)
    message = outcome.describe()
    assert outcome.codes == [0, 0] and not outcome.timed_out, message
    reports = _reports("".join(outcome.outputs))
    size = 2 * per_pod
    assert sorted(reports) == list(range(size)), message
    hostnames = [pod.hostname for pod in pods for _ in range(per_pod)]
    for rank, report in reports.items():
        assert report["size"] == size and report["hosts"] == hostnames, message
        assert (report["local_rank"], report["local_size"]) == (rank % per_pod, per_pod)
        assert (report["cross_rank"], report["cross_size"]) == (rank // per_pod, 2), message
        assert report["allreduce_error"] <= 1e-12 and report["agreed"], message
    print(f"{kind}: kd.init() took {reports[0]['init_seconds']:.2f} s on rank 0")
    assert outcome.leftovers == [] and outcome.shm_left == [], message


@netns
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_mnist_example_in_an_indexed_job(hosts, secret_file, tmp_path):
    with np.load(MNIST / "mnist_5k.npz") as data:  # a few steps: 768 digits, 3 batches a rank
        np.savez(tmp_path / "digits.npz", x_train=data["x_train"][:768],
                 y_train=data["y_train"][:768], x_test=data["x_test"][:256],
                 y_test=data["y_test"][:256])
    command = [sys.executable, str(MNIST / "train.py"), "--epochs", "1", "--batch-size", "128",
               "--data", str(tmp_path / "digits.npz"), "--checkpoint-dir", str(tmp_path / "ckpt")]
    _, fixture_env, _, entries = hosts
    outcome = Pods(_pods("indexed-job", entries, command, secret_file),
                   _network(fixture_env)).wait(130)
    message = outcome.describe()
    assert outcome.codes == [0, 0] and not outcome.timed_out, message
    assert "2 rank(s); 768 training and 256 test digits" in outcome.outputs[0], message
    same = re.search(r"weights on every rank: (\w+) \((\w+), (\w+)\)", outcome.outputs[0])
    assert same and same[1] == "identical" and same[2] == same[3], message
    assert outcome.leftovers == [] and outcome.shm_left == [], message


# --- a pod's process dies ------------------------------------------------------------


@netns
@pytest.mark.timeout(120)
def test_a_process_killed_in_one_pod_ends_every_process_of_both(hosts, secret_file, tmp_path):
    # Two processes a pod, so that each pod has MPICH's and keras_dist's shared
    # memory to leave behind.
    _, fixture_env, _, entries = hosts
    pods = _pods("indexed-job", entries, [sys.executable, WORKER, "loop"], secret_file, per_pod=2)
    job = Pods(pods, {**_network(fixture_env), "K8S_READY_DIR": str(tmp_path)})
    up, mapped = None, False
    try:
        deadline = time.monotonic() + 60
        while (len(os.listdir(tmp_path)) < 4 and time.monotonic() < deadline
               and all(proc.poll() is None for proc in job.procs)):
            time.sleep(0.1)
        up = re.search(r"^UP 2 (\S+) (\d+)$", job.output(2), re.MULTILINE)
        # Not vacuous: the pods hold shared memory (MPICH's, keras_dist's) when one dies.
        mapped = job.segments.wait_for(SHM_PREFIXES, timeout=20)
        if up and len(os.listdir(tmp_path)) == 4 and mapped:
            os.kill(int(up[2]), signal.SIGKILL)
        killed = time.monotonic()
    finally:
        outcome = job.wait(100)
    message = outcome.describe()
    assert up is not None and up[1] == pods[2].hostname and mapped, message
    assert not outcome.timed_out and outcome.codes == [1, 1, -signal.SIGKILL, 1], message
    for rank in (0, 1, 3):
        assert (f"[keras_dist rank {rank}/4] ending this rank: rank 2 (host {pods[2].hostname}, "
                f"pid {up[2]})") in outcome.outputs[rank], message
    print(f"every process had ended {outcome.ended - killed:.2f} s after the kill")
    assert outcome.leftovers == [] and outcome.shm_left == [], message
