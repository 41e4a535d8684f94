"""An elastic job loses a host (issue 11): two "hosts" that are network
namespaces of this machine (the fixture of test_multihost.py), 2 ranks each.
While the job trains, every process of the second host is SIGKILLed and its
link goes down. kdrun finds the host unreachable, leaves it out, and launches
again on the first host's 2 slots (--min-np 2); the ranks resume from the
commit the first host holds (no shared state: each host keeps its own copy)
and finish. The result is checked against numpy's float64 sum of the steps:
those before the commit at 4 ranks, the rest at 2.

Needs root and ``ip netns``; skipped otherwise.
"""

import glob
import json
import os
import subprocess
import time

import numpy as np
import pytest

from tests._mp import start_job
from tests.elastic.test_elastic_launcher import expected_weights
from tests.faults.test_multihost import hosts  # noqa: F401  (the fixture)

WORKER = "tests/elastic/object_worker.py"
STEPS = 60

pytestmark = [pytest.mark.timeout(150)]


def _steps_committed(state_dir, hostname):
    found = glob.glob(os.path.join(state_dir, "keras_dist-elastic-*", hostname, "commit-*.npz"))
    return max((int(p.rsplit("-", 1)[1].split(".")[0]) for p in found), default=0)


def test_a_lost_host_is_left_out_and_the_job_goes_on(hosts, tmp_path):  # noqa: F811
    host_list, env, namespaces, entries = hosts
    state_dir = str(tmp_path / "state")
    out = tmp_path / "out"
    out.mkdir()
    job = start_job(["python", WORKER, str(out), str(STEPS)], np=4,
                    env={**env, "KERAS_DIST_ELASTIC_DIR": state_dir, "KD_STEP_SLEEP": "0.1"},
                    kdrun_args=["-H", host_list, "--min-np", "2", "--max-restarts", "1",
                                "--host-cooldown", "600"])
    try:
        deadline = time.monotonic() + 60
        while _steps_committed(state_dir, entries[1][2]) < 5 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = subprocess.run(["ip", "netns", "pids", namespaces[1]], capture_output=True,
                              text=True, timeout=30).stdout.split()
        subprocess.run(["ip", "-n", namespaces[1], "link", "set", "eth0", "down"], check=True,
                       timeout=30)
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except OSError:
                pass
        result = job.wait(120)
    finally:
        job.kill()
        subprocess.run(["ip", "-n", namespaces[1], "link", "set", "eth0", "up"], timeout=30)
    message = result.describe()
    assert result.returncode == 0, message
    assert f"host {entries[1][0]} lost; restarting (restart 1 of 1)" in result.launcher_stderr, (
        message)
    assert "launch 2 on 2 rank(s)" in result.launcher_stderr, message
    logs = [json.loads(p.read_text()) for p in sorted(out.glob("launch1.rank*.json"))]
    assert [log["rank"] for log in logs] == [0, 1], message
    resumed = logs[0]["start"]
    assert 5 <= resumed < STEPS, message
    expected = expected_weights(resumed, 4) + (
        expected_weights(STEPS, 2) - expected_weights(resumed, 2))
    for log in logs:
        assert log["size"] == 2 and log["resets"] == 1, log
        np.testing.assert_allclose(log["weights"], expected, rtol=1e-12, err_msg=message)
    assert not glob.glob(os.path.join(state_dir, "keras_dist-elastic-*")), message
