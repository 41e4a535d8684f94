"""kdrun's elastic mode with a light worker (object_worker.py: ObjectState, an
allreduce per step, a commit per step): relaunch after a rank is killed at a
random step, giving up past --max-restarts and below --min-np. The final
weights are checked against numpy's float64 sum of the same steps."""

import glob
import json
import os
import random

import numpy as np
import pytest

from tests._mp import run_job

WORKER = "tests/elastic/object_worker.py"
TIMEOUT = 90

pytestmark = pytest.mark.timeout(TIMEOUT + 30)


def expected_weights(steps: int, size: int) -> np.ndarray:
    """The worker's weights after ``steps`` steps at ``size`` ranks, in float64."""
    weights = np.zeros(4)
    for step in range(steps):
        weights += np.mean([np.sin(np.arange(4) + step) * (rank + 1) for rank in range(size)],
                           axis=0)
    return weights


def _logs(out):
    found = {}
    for path in glob.glob(os.path.join(out, "launch*.rank*.json")):
        with open(path) as f:
            log = json.load(f)
        found[(log["launch"], log["rank"])] = log
    return found


def _env(tmp_path, **values):
    """The job's environment: its committed state kept under tmp_path/state."""
    return {"KERAS_DIST_ELASTIC_DIR": str(tmp_path / "state"), **values}


def _no_state_left(tmp_path):
    left = glob.glob(str(tmp_path / "state" / "keras_dist-elastic-*"))
    assert not left, left


def test_a_rank_killed_at_a_random_step_costs_only_that_step(tmp_path):
    seed = random.randrange(1 << 30)
    chosen = random.Random(seed)
    rank, step = chosen.randrange(2), chosen.randrange(1, 29)
    result = run_job(["python", WORKER, str(tmp_path), "30"], np=2, timeout=TIMEOUT,
                     env=_env(tmp_path, KD_KILL_RANK=str(rank), KD_KILL_STEP=str(step),
                              KD_STEP_SLEEP="0.02"),
                     kdrun_args=["--max-restarts", "1"])
    message = f"seed {seed}: rank {rank} killed before step {step}\n{result.describe()}"
    assert result.returncode == 0 and not result.leftovers, message
    assert f"rank {rank} failed; restarting (restart 1 of 1)" in result.launcher_stderr, message
    logs = _logs(str(tmp_path))
    assert sorted(logs) == [(1, 0), (1, 1)], message
    for log in logs.values():
        assert log["start"] == step and log["resets"] == 1, (log, message)
        np.testing.assert_allclose(log["weights"], expected_weights(30, 2), rtol=1e-12,
                                   err_msg=message)
    _no_state_left(tmp_path)


def test_giving_up_past_max_restarts(tmp_path):
    result = run_job(["python", WORKER, str(tmp_path), "10"], np=2, timeout=TIMEOUT,
                     env=_env(tmp_path, KD_KILL_RANK="1", KD_KILL_STEP="2",
                              KD_KILL_LAUNCH="all"),
                     kdrun_args=["--max-restarts", "1"])
    assert result.returncode != 0 and not result.leftovers, result.describe()
    assert "restart 1 of 1" in result.launcher_stderr, result.describe()
    assert "no restart left (--max-restarts 1); giving up" in result.launcher_stderr, (
        result.describe())
    assert result.launcher_stderr.count("failed first: killed by SIGKILL") == 2, (
        result.describe())
    _no_state_left(tmp_path)


def test_giving_up_below_min_np(tmp_path):
    flag = tmp_path / "one-slot-left"
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\nif [ -e {flag} ]; then echo localhost:1; "
                      "else echo localhost:2; fi\n")
    script.chmod(0o755)
    result = run_job(["python", WORKER, str(tmp_path), "10"], np=2, timeout=TIMEOUT,
                     env=_env(tmp_path, KD_KILL_RANK="1", KD_KILL_STEP="3",
                              KD_TOUCH_BEFORE_KILL=str(flag)),
                     kdrun_args=["--min-np", "2", "--elastic-timeout", "2",
                                 "--host-discovery-script", str(script)])
    assert result.returncode != 0 and not result.leftovers, result.describe()
    assert "fewer than --min-np 2 slots usable after 2 s; giving up" in result.launcher_stderr, (
        result.describe())
    _no_state_left(tmp_path)
