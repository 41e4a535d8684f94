"""The emulated-hosts harness (benchmarks/emulated_hosts.py), run small: two
network-namespace hosts on a bridge, each host's egress shaped to 1 Gbit/s;
a job started through kdrun's host file and one whose processes start
themselves, each checking an allreduce against float64; nothing left
afterwards, whether the run ends by itself or is stopped; and the cross-host
allreduce benchmark (benchmarks/emulated_hosts_allreduce.py), run tiny, with
every peer's result checked; and the training benchmark
(benchmarks/emulated_hosts_train.py), a few steps of the MLP through
keras_dist and PyTorch DDP, weights equal on every rank and losses finite.

Needs root, ``ip netns``, ``tc`` and ``unshare``; skipped otherwise.
"""

import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys

import pytest

from benchmarks.emulated_hosts import leftovers, namespaces_with_prefix
from tests._mp import REPO_ROOT, job_environment

HARNESS = str(REPO_ROOT / "benchmarks" / "emulated_hosts.py")
WORKER = str(REPO_ROOT / "tests" / "faults" / "emulated_hosts_worker.py")
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1",
       "KERAS_DIST_TIMEOUT_SECONDS": "30", "KERAS_DIST_RENDEZVOUS_TIMEOUT": "30"}


def _netns_usable() -> str | None:
    """Why network namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"needs `{tool}`"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        return f"`ip netns` is unavailable: {probe.stderr.decode(errors='replace').strip()}"
    return None


pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(_netns_usable() is not None, reason=str(_netns_usable())),
]


def _prefix() -> str:
    return f"kdet{secrets.token_hex(3)}"


def _harness(prefix, mode, *command, ranks_per_host=1, link_seconds="0.5"):
    return [sys.executable, HARNESS, "--hosts", "2", "--ranks-per-host", str(ranks_per_host),
            "--rate", "1gbit", "--prefix", prefix, "--link-seconds", link_seconds,
            "--timeout", "45", mode, "--", sys.executable, *command]


def _reports(output: str) -> list[dict]:
    reports = [json.loads(line.split("REPORT ", 1)[1]) for line in output.splitlines()
               if "REPORT " in line]
    return sorted(reports, key=lambda report: report["rank"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("mode,ranks_per_host", [("kdrun", 1), ("selfstart", 2)])
def test_allreduce_across_emulated_hosts(mode, ranks_per_host):
    prefix = _prefix()
    done = subprocess.run(_harness(prefix, mode, WORKER, "check",
                                   ranks_per_host=ranks_per_host),
                          capture_output=True, text=True, timeout=75, env=ENV)
    message = f"rc={done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, message
    # The hosts were made under the run's prefix, and the link was measured.
    assert f"# made: netns {prefix}sw {prefix}h0 {prefix}h1" in done.stdout, message
    link = [line for line in done.stdout.splitlines() if line.startswith("# link: ")]
    assert len(link) == 1 and " MB/s " in link[0], message
    size = 2 * ranks_per_host
    reports = _reports(done.stdout)
    assert [report["rank"] for report in reports] == list(range(size)), message
    hosts = [report["host"] for report in reports]
    assert hosts == [f"{prefix}-host{r // ranks_per_host}" for r in range(size)], message
    for report in reports:
        assert report["ok"] and report["size"] == size, message
        assert (report["cross_size"], report["local_size"]) == (2, ranks_per_host), message
    # Nothing left: the run says so, and so do the namespaces and processes here.
    assert "# cleanup: nothing left" in done.stdout, message
    assert leftovers(prefix) == [], message
    assert not any(_alive(report["pid"]) for report in reports), message


def test_a_stopped_run_leaves_nothing():
    prefix = _prefix()
    harness = subprocess.Popen(_harness(prefix, "selfstart", WORKER, "hold", link_seconds="0"),
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        seen = []
        for line in harness.stdout:
            seen.append(line)
            if line.startswith("# started: pids "):
                break
        pids = [int(pid) for pid in seen[-1].split()[3:]] if seen else []
        # While it runs, its hosts and their processes exist.
        existing = namespaces_with_prefix(prefix)
        running = [pid for pid in pids if _alive(pid)]
        harness.send_signal(signal.SIGTERM)
        rest, _ = harness.communicate(timeout=60)
    finally:
        if harness.poll() is None:
            harness.kill()
    message = "".join(seen) + rest
    assert sorted(existing) == sorted([f"{prefix}sw", f"{prefix}h0", f"{prefix}h1"]), message
    assert len(pids) == 2 and running == pids, message
    assert harness.returncode == 128 + signal.SIGTERM, message
    assert "# cleanup: nothing left" in rest, message
    assert leftovers(prefix) == [], message
    assert not any(_alive(pid) for pid in pids), message


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_cross_host_benchmark_checks_every_peer():
    peers = "kd,mpi,gloo" if importlib.util.find_spec("torch") else "kd,mpi"
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "emulated_hosts_allreduce.py"),
         "--layouts", "2x1", "-b", "4K", "-e", "64K", "-f", "16", "--reps", "1",
         "--peers", peers, "--latency-calls", "10", "--link-seconds", "0.5",
         "--timeout", "100"],
        capture_output=True, text=True, timeout=130, env=ENV)
    message = f"rc={done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, message
    rows = [line.split("|") for line in done.stdout.splitlines()
            if re.match(r"^\[0\]\s+\d+\s+\d+\s+float\s+sum", line)]
    assert [int(row[0].split()[1]) for row in rows] == [4096, 65536], message
    for row in rows:  # every peer's #wrong is 0
        assert [cells.split()[-1] for cells in row[1:1 + len(peers.split(","))]] == \
            ["0"] * len(peers.split(",")), message
    assert "# cleanup: nothing left" in done.stdout, message


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (DDP)")
def test_the_cross_host_training_benchmark_checks_keras_dist_and_ddp():
    # Most of its time is each rank importing its frameworks. The ranks run
    # Keras on PyTorch (DDP needs torch anyway), TensorFlow and JAX hidden
    # (tests/_tf_only): one framework a rank.
    env = job_environment({**ENV, "KERAS_BACKEND": "torch"},
                          hide=("tensorflow", "jax", "jaxlib", "matplotlib"))
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "emulated_hosts_train.py"),
         "--hosts", "2", "--models", "mlp", "--kinds", "keras_dist,DDP",
         "--steps", "2", "--reps", "1", "--warmup", "1", "--link-seconds", "0.5",
         "--timeout", "240"],
        capture_output=True, text=True, timeout=270, env=env)
    message = f"rc={done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, message
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in done.stdout.splitlines()
               if "RESULT " in line]
    assert [(r["model"], r["hosts"], r["config"]) for r in results] == \
        [("mlp", 2, "keras_dist"), ("mlp", 2, "DDP")], message
    assert all(result["step_ms"] > 0 for result in results), message
    assert "checked: weights equal on every rank (0 ranks differ), losses finite (0 not)" \
        in done.stdout, message
    assert "# ranks done, 0 failed checks" in done.stdout, message
    assert "# cleanup: nothing left" in done.stdout, message
