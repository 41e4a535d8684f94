"""kdrun inside Slurm jobs, on a real Slurm cluster built for the test.

The cluster: slurmctld on this machine, and two nodes, each a slurmd in a
network namespace of its own with its own host name (as test_multihost.py
builds its hosts), joined by a bridge. Authentication is ``auth/none``, so
munge is not needed. Jobs are submitted with ``sbatch`` and ``salloc``; their
batch scripts call ``kdrun`` without hosts, so kdrun takes the nodes and slots
from Slurm's environment and hydra starts its proxies with ``srun``.

Needs root, ``ip``, ``unshare`` and Slurm's daemons and clients
(``apt-get install slurmctld slurmd slurm-client``, about 15 s on Debian 12);
skipped, with the reason, when any is missing or the cluster does not start.
Every daemon and job process is stopped at the end, and the test fails if one
is left.
"""

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from keras_dist.launcher.cleanup import find_job_processes, kill_processes_with_env
from tests._mp import REPO_ROOT, TAG_ENV
from tests.faults.bridge import BridgedNamespaces

HERE = Path(__file__).parent
WORKER = str(HERE / "slurm_worker.py")
NODE_SCRIPT = str(HERE / "slurm_node.sh")
SLURM_PROGRAMS = ("slurmctld", "slurmd", "sbatch", "salloc", "srun", "sinfo", "squeue",
                  "scancel")
# Hard limits, in seconds, on a job and on the cluster's start.
JOB_TIMEOUT = 120
START_TIMEOUT = 60

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None
                       or shutil.which("unshare") is None,
                       reason="needs root, ip and unshare"),
]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _cgroup_mounts() -> list[str]:
    """The host's mounts under /sys/fs/cgroup as slurm_node.sh's triples."""
    triples = []
    with open("/proc/self/mounts") as handle:
        for line in handle:
            _, mountpoint, fstype, options = line.split()[:4]
            if mountpoint == "/sys/fs/cgroup" or mountpoint.startswith("/sys/fs/cgroup/"):
                triples += [fstype, mountpoint, options]
    return triples


class Cluster:
    """A running test cluster; ``submit`` runs a batch script on it."""

    def __init__(self, root: str, tag: str, nodes: list[str], env: dict[str, str]):
        self.root, self.tag, self.nodes, self.env = root, tag, nodes, env
        self.daemons: list[subprocess.Popen] = []

    def logs(self) -> str:
        """The daemons' logs, for assertion messages."""
        parts = []
        for path in sorted(Path(self.root, "log").iterdir()):
            text = path.read_text(errors="replace")
            parts.append(f"----- {path.name}:\n{text[-6000:]}")
        return "\n".join(parts)

    def run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def node_states(self) -> dict[str, str]:
        result = self.run("sinfo", "-h", "-N", "-o", "%N %T")
        return dict(line.split() for line in result.stdout.splitlines() if line.strip())

    def submit(self, script: str, *sbatch_args: str) -> tuple[str, str]:
        """Runs ``script`` (shell) with ``sbatch``; returns (job id, the job's output).

        The job is cancelled, and the test fails with its output, if it has not
        ended within JOB_TIMEOUT seconds.
        """
        path = Path(self.root, f"job-{secrets.token_hex(3)}.sh")
        path.write_text("#!/bin/sh\n" + script)
        output = str(path) + ".out"
        result = self.run("sbatch", "--parsable", "--time=3", "-o", output, *sbatch_args,
                          str(path))
        assert result.returncode == 0, f"sbatch failed: {result.stderr}\n{self.logs()}"
        job_id = result.stdout.strip().split(";")[0]
        deadline = time.monotonic() + JOB_TIMEOUT
        while self.run("squeue", "-h", "-j", job_id, "-o", "%i").stdout.strip():
            if time.monotonic() > deadline:
                self.run("scancel", job_id)
                text = Path(output).read_text(errors="replace") if os.path.exists(output) \
                    else "(no output)"
                pytest.fail(f"Slurm job {job_id} still ran after {JOB_TIMEOUT} s; "
                            f"cancelled. Its output:\n{text}\n{self.logs()}")
            time.sleep(0.5)
        text = Path(output).read_text(errors="replace") if os.path.exists(output) else ""
        return job_id, text


def _start(cluster: Cluster, args: list[str], name: str, netns: str | None = None) -> None:
    log = open(Path(cluster.root, "log", f"{name}.out"), "wb")
    command = ["ip", "netns", "exec", netns, *args] if netns else args
    cluster.daemons.append(subprocess.Popen(
        command, env=cluster.env, stdout=log, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True))
    log.close()


def _stop(cluster: Cluster) -> list[str]:
    """Stops every job, daemon and process of the cluster; returns what outlived it."""
    try:
        cluster.run("scancel", "--full", "-u", "root")
    except (OSError, subprocess.TimeoutExpired):
        pass
    for daemon in cluster.daemons:
        daemon.terminate()
    for daemon in cluster.daemons:
        try:
            daemon.wait(15)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(15)
    # slurmstepd and the jobs' processes carry the tag of the environment
    # they were started from (the daemons' or sbatch's).
    left = find_job_processes(TAG_ENV, cluster.tag)
    kill_processes_with_env(TAG_ENV, cluster.tag)
    return [f"{pid} {Path(f'/proc/{pid}/cmdline').read_bytes()!r}" for pid in left
            if os.path.exists(f"/proc/{pid}")]


@pytest.fixture(scope="module")
def cluster():
    """slurmctld and two slurmd "nodes" of 4 CPUs each, torn down after the module."""
    missing = [name for name in SLURM_PROGRAMS if shutil.which(name) is None]
    if missing:
        pytest.skip(f"Slurm is not installed: {', '.join(missing)} not on PATH "
                    "(apt-get install slurmctld slurmd slurm-client)")
    tag = secrets.token_hex(3)
    subnet = f"10.{180 + int(tag[0], 16)}.{int(tag[1:3], 16) % 250}"
    bridge = f"kdsb{tag}"
    # Names Slurm writes compressed ("kdsl<tag>-[1-2]"), so that kdrun expands them.
    names = [f"kdsl{tag}-{number}" for number in (1, 2)]
    namespaces = [f"kdsn{tag}{letter}" for letter in "ab"]
    root = tempfile.mkdtemp(prefix="kdslurm-")
    os.chmod(root, 0o755)
    for sub in ("state", "log", *(f"spool-{name}" for name in names)):
        os.makedirs(os.path.join(root, sub))
    network = BridgedNamespaces(bridge, subnet, namespaces, f"kdsv{tag}")
    try:
        network.build()
    except (subprocess.CalledProcessError, OSError) as error:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"cannot build network namespaces here: {error}")

    controller = socket.gethostname().split(".")[0]
    node_lines = "\n".join(
        f"NodeName={name} NodeAddr={subnet}.{index + 2} CPUs=4 State=UNKNOWN"
        for index, name in enumerate(names))
    conf = Path(root, "slurm.conf")
    conf.write_text(f"""\
ClusterName=kdtest{tag}
SlurmctldHost={controller}({subnet}.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
{node_lines}
PartitionName=test Nodes={",".join(names)} Default=YES MaxTime=INFINITE State=UP
""")
    env = {name: value for name, value in os.environ.items() if not name.startswith("SLURM_")}
    env.update({
        "SLURM_CONF": str(conf),
        TAG_ENV: tag,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                    os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        # hydra's control connections and MPI's data cross the nodes' eth0.
        "HYDRA_IFACE": "eth0",
        "UCX_TLS": "tcp,self",
        "UCX_NET_DEVICES": "eth0",
        "FI_PROVIDER": "tcp",
        "TF_NUM_INTRAOP_THREADS": "1",
        "TF_NUM_INTEROP_THREADS": "1",
        "OMP_NUM_THREADS": "1",
    })
    running = Cluster(root, tag, names, env)
    try:
        _start(running, ["slurmctld", "-D", "-i", "-f", str(conf)], "slurmctld-stdout")
        for name, namespace in zip(names, namespaces):
            _start(running, [NODE_SCRIPT, name, str(conf), *_cgroup_mounts()],
                   f"slurmd-{name}-stdout", netns=namespace)
        deadline = time.monotonic() + START_TIMEOUT
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = running.node_states()
            if all(states.get(name) == "idle" for name in names):
                break
            if any(daemon.poll() is not None for daemon in running.daemons):
                break
            time.sleep(0.5)
        else:
            states = running.node_states()
        if not all(states.get(name) == "idle" for name in names):
            pytest.skip(f"cannot start Slurm here: nodes {states or 'unknown'} after "
                        f"{START_TIMEOUT} s\n{running.logs()}")
        yield running
    finally:
        left = _stop(running)
        network.remove()
        shutil.rmtree(root, ignore_errors=True)
    assert not left, f"processes of the Slurm cluster outlived it: {left}"


def _kdrun_script(*kdrun_args: str, env: str = "") -> str:
    """A batch script: the allocation's variables, then ``kdrun [args] python worker``."""
    return (
        f"cd {REPO_ROOT}\n"
        'echo "JOBENV $SLURM_JOB_NODELIST $SLURM_TASKS_PER_NODE $SLURM_NTASKS"\n'
        f"{env} {sys.executable} -m keras_dist.run {' '.join(kdrun_args)} "
        f"{sys.executable} {WORKER}\n"
        'echo "KDRUN_EXIT $?"\n'
    )


def _parse(output: str) -> tuple[list[str], int | None, list[dict]]:
    """(JOBENV fields, kdrun's exit status, REPORTs by rank) from a job's output."""
    jobenv = next((line.split()[1:] for line in output.splitlines()
                   if line.startswith("JOBENV ")), [])
    exits = re.findall(r"^KDRUN_EXIT (\d+)$", output, re.MULTILINE)
    reports = [json.loads(line[line.index("REPORT ") + len("REPORT "):])
               for line in output.splitlines() if "REPORT " in line]
    return jobenv, int(exits[0]) if exits else None, sorted(reports, key=lambda r: r["rank"])


def _check_job(cluster: Cluster, job_id: str, output: str, expected_size: int) -> list[dict]:
    """Checks kdrun succeeded and every rank's results; returns the reports."""
    message = f"\n----- Slurm job {job_id} output:\n{output}\n{cluster.logs()}"
    jobenv, status, reports = _parse(output)
    assert status == 0, message
    assert [r["rank"] for r in reports] == list(range(expected_size)), message
    for report in reports:
        assert report["size"] == expected_size, message
        assert report["sum_error"] <= 1e-5 and report["average_error"] <= 1e-5, message
        assert report["allgather_exact"] and report["broadcast_exact"], message
        assert report["dtypes"] == ["float32", "float32"], message
        assert report["slurm_job_id"] == job_id, message
        # Started by hydra's proxy in a Slurm step (srun), not by the batch script.
        assert report["slurm_step_id"] not in (None, "batch"), message
    return reports


def _expected_hosts(cluster: Cluster, nodelist: str, tasks_per_node: str) -> list[str]:
    """The host of each rank, filling the job's nodes in order (independently of kdrun)."""
    prefix = cluster.nodes[0][:-1]
    nodes = cluster.nodes if nodelist == prefix + "[1-2]" else [nodelist]
    assert set(nodes) <= set(cluster.nodes), nodelist
    counts = []
    for item in tasks_per_node.split(","):
        count, _, repeat = item.partition("(x")
        counts += [int(count)] * int(repeat.rstrip(")") or 1)
    return [node for node, count in zip(nodes, counts) for _ in range(count)]


@pytest.mark.parametrize(
    "sbatch_args, transport, size",
    [
        # Uneven: two ranks on one node, one on the other.
        (("-N", "2", "-n", "3"), "mpi", 3),
        (("-N", "2", "--ntasks-per-node=2"), "auto", 4),
        (("-N", "1", "-n", "2"), "auto", 2),
    ],
    ids=["2-nodes-uneven-mpi", "2-nodes-2-each-auto", "1-node-auto"],
)
def test_sbatch_kdrun_takes_the_nodes_from_slurm(cluster, sbatch_args, transport, size):
    script = _kdrun_script(env=f"KERAS_DIST_CPU_OPERATIONS={transport}")
    job_id, output = cluster.submit(script, *sbatch_args)
    reports = _check_job(cluster, job_id, output, size)
    jobenv, _, _ = _parse(output)
    message = f"\n{output}"
    nodelist, tasks_per_node, ntasks = jobenv
    assert int(ntasks) == size, message
    hosts = _expected_hosts(cluster, nodelist, tasks_per_node)
    assert [r["host"] for r in reports] == hosts, message
    for report in reports:
        same_host = [r["rank"] for r in reports if r["host"] == report["host"]]
        assert report["local_size"] == len(same_host), message
        assert report["local_rank"] == same_host.index(report["rank"]), message
    if "-N" in sbatch_args and sbatch_args[sbatch_args.index("-N") + 1] == "2":
        assert len(set(hosts)) == 2, message


def test_sbatch_np_below_the_tasks(cluster):
    job_id, output = cluster.submit(_kdrun_script("-np", "2"), "-N", "2", "-n", "4")
    reports = _check_job(cluster, job_id, output, 2)
    jobenv, _, _ = _parse(output)
    # Ranks fill the first node's slots first.
    assert [r["host"] for r in reports] == _expected_hosts(cluster, *jobenv[:2])[:2], output


def test_np_above_the_tasks_is_refused_before_anything_starts(cluster):
    result = cluster.run(
        "salloc", "-N", "2", "-n", "2", sys.executable, "-m", "keras_dist.run", "-np", "3",
        sys.executable, WORKER, timeout=JOB_TIMEOUT)
    message = f"salloc output:\n{result.stdout}\n{result.stderr}\n{cluster.logs()}"
    assert result.returncode == 2, message
    assert re.search(r"kdrun: `-np` must be at most the 2 slots of the hosts \(Slurm job "
                     r"\d+: kdsl\w+-1:1,kdsl\w+-2:1\)\. Received: -np 3", result.stderr), message
    assert "REPORT" not in result.stdout, message
