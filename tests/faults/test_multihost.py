"""Several machines, simulated: each "host" is a network namespace of this
machine with its own hostname, joined to the launching namespace by a bridge;
hydra starts its proxies there through netns_launcher.sh (in place of ssh),
and UCX is restricted to TCP so that MPI really crosses the (virtual) network.

Needs root and ``ip netns``; skipped otherwise.
"""

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests._mp import run_job, start_job
from tests.faults.bridge import BridgedNamespaces

HERE = Path(__file__).parent
WORKER = str(HERE / "multihost_worker.py")
LAUNCHER = str(HERE / "netns_launcher.sh")

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None
                       or shutil.which("unshare") is None,
                       reason="needs root, ip and unshare"),
]


@pytest.fixture(scope="module")
def hosts():
    """Two "hosts" of 2 slots each; yields (kdrun -H value, env for run_job, netns names)."""
    tag = secrets.token_hex(2)
    subnet = f"10.{200 + int(tag[0], 16)}.{int(tag[1:], 16) % 250}"
    bridge, namespaces = f"kdbr{tag}", [f"kdns{tag}a", f"kdns{tag}b"]
    network = BridgedNamespaces(bridge, subnet, namespaces, f"kdv{tag}")
    try:
        network.build()
    except (subprocess.CalledProcessError, OSError) as error:
        pytest.skip(f"cannot build network namespaces here: {error}")
    entries = [(address, namespace, f"kdhost{tag}{'ab'[index]}")
               for index, (address, namespace)
               in enumerate(zip(network.addresses, namespaces))]
    env = {
        "HYDRA_LAUNCHER": "ssh",
        "HYDRA_LAUNCHER_EXEC": LAUNCHER,
        "HYDRA_IFACE": bridge,
        "KD_NETNS_HOSTS": ",".join("=".join(entry) for entry in entries),
        "KD_LAUNCH_ADDRESS": f"{subnet}.1",
        "UCX_TLS": "tcp,self",
        "UCX_NET_DEVICES": "eth0",
        "FI_PROVIDER": "tcp",
    }
    try:
        yield ",".join(f"{address}:2" for address, _, _ in entries), env, namespaces, entries
    finally:
        network.remove()


def _reports(result, np_):
    reports = []
    for rank in range(np_):
        lines = [line for line in result.rank_stdout.get(rank, "").splitlines()
                 if line.startswith("REPORT ")]
        assert len(lines) == 1, result.describe()
        reports.append(json.loads(lines[0][len("REPORT "):]))
    return reports


@pytest.mark.parametrize("transport", ["mpi", "auto"])
def test_collectives_across_hosts(hosts, transport):
    host_list, env, _, entries = hosts
    result = run_job([sys.executable, WORKER, "check"], np=4, timeout=90,
                     env={**env, "KERAS_DIST_CPU_OPERATIONS": transport},
                     kdrun_args=["-H", host_list]).check()
    reports = _reports(result, 4)
    message = result.describe()
    names = [name for _, _, name in entries]
    assert [r["host"] for r in reports] == [names[0], names[0], names[1], names[1]], message
    assert [(r["local_rank"], r["local_size"]) for r in reports] == [(0, 2), (1, 2)] * 2
    assert [(r["cross_rank"], r["cross_size"]) for r in reports] == [(0, 2), (0, 2),
                                                                     (1, 2), (1, 2)]
    for report in reports:
        assert report["allreduce_ok"] and report["allgather_ok"] and report["broadcast_ok"], (
            message)
    assert all(report["tcp_to_other_hosts"] > 0 for report in reports), message


def _start_loop(hosts):
    host_list, env, _, _ = hosts
    ready_dir = tempfile.mkdtemp(prefix="kdready-")
    job = start_job([sys.executable, WORKER, "loop"], np=4,
                    env={**env, "FAULT_READY_DIR": ready_dir}, kdrun_args=["-H", host_list])
    deadline = time.monotonic() + 60
    while (len(os.listdir(ready_dir)) < 4 and job.proc.poll() is None
           and time.monotonic() < deadline):
        time.sleep(0.2)
    shutil.rmtree(ready_dir, ignore_errors=True)
    return job


def test_a_rank_killed_on_another_host_is_named(hosts):
    # Rank 2's supervisor, on the second "host", records the kill; the record
    # reaches kdrun through hydra's proxy there and mpiexec.
    _, _, namespaces, entries = hosts
    job = _start_loop(hosts)
    pids = subprocess.run(["ip", "netns", "pids", namespaces[1]], capture_output=True,
                          text=True, timeout=30).stdout.split()
    try:
        with open(os.path.join(job.output_dir, "rank2.stdout")) as handle:
            rank_2 = int(handle.read().split()[3])
    except (OSError, IndexError, ValueError):
        rank_2 = None
    if rank_2 is not None and str(rank_2) in pids:
        os.kill(rank_2, 9)
    result = job.wait(45)
    message = result.describe()
    assert rank_2 is not None and str(rank_2) in pids, message
    assert result.returncode != 0 and not result.timed_out, message
    named = re.findall(r"^kdrun: rank (\d+) \(pid (\d+) on (\S+)\) failed first: (.*)$",
                       result.launcher_stderr, re.MULTILINE)
    assert len(named) == 1, message
    assert named[0][:3] == ("2", str(rank_2), entries[1][2]), message
    assert named[0][3] in ("killed by SIGKILL", "it ended before it could record how; "
                           "rank 3 reported its failure"), message
    assert result.leftovers == [], message


def test_losing_a_host_ends_the_job(hosts):
    _, _, namespaces, entries = hosts
    job = _start_loop(hosts)
    pids = subprocess.run(["ip", "netns", "pids", namespaces[1]], capture_output=True,
                          text=True, timeout=30).stdout.split()
    for pid in pids:  # hydra's proxy, the supervisors and the ranks there
        try:
            os.kill(int(pid), 9)
        except OSError:
            pass
    result = job.wait(45)
    message = result.describe()
    assert pids, message
    assert result.returncode != 0 and not result.timed_out, message
    # Nothing there could record anything: kdrun says so, naming the host's ranks.
    assert f"2, 3 (on {entries[1][2]})" in result.launcher_stderr, message
    assert "ended without an exit record" in result.launcher_stderr, message
    assert result.leftovers == [], message
