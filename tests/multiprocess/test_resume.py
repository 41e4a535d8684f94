"""Resume after a kill (issue 5, item 8), with keras_workers/resume.py.

A: 2 ranks, 4 epochs, uninterrupted. B: the same job, with rank 1 SIGKILLing
itself at the second batch of epoch 3, after rank 0's ``ModelCheckpoint`` wrote
``ckpt-2.keras``; kdrun must fail. Then from B's ``ckpt-2.keras``
(``kd.load_model`` + ``fit(initial_epoch=2)``):

- at 2 ranks, the loaded state is A's state after epoch 2, bit for bit, and
  epochs 3 and 4 end with A's weights and optimizer state bit for bit (same
  data order, same kernels single-threaded, float32 values stored exactly);
- at 1 rank (same global batch of 32), it loads the same state and trains to
  the end; the result equals A's up to float32 rounding only: one rank takes
  the mean gradient over 32 samples where two ranks average two means over
  16, the same number summed in a different order.

The transport is the default one (set ``KERAS_DIST_CPU_OPERATIONS`` outside
to choose). Three jobs: B; then A and the 2-rank resume one after another in
one job of 2 ranks (``workers/suites.py``: one start of TensorFlow for both,
each read from its own section of the output); then the 1-rank resume.
"""

import json
import math
import re
import shutil
import sys

import numpy as np
import pytest

from tests._mp import run_job
from tests.multiprocess._shared_jobs import RUNNER, suite_output

WORKER = "tests/multiprocess/keras_workers/resume.py"
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}
EPOCHS, KILL_AFTER, STEPS = 4, 2, 8  # as in the worker
JOB_TIMEOUT = 100


def _state(npz, prefix, paths_key="paths"):
    """{variable name: value} for one snapshot; the names without the model's
    own prefix (a loaded Sequential's variables lose the "sequential/" part)."""
    names = [re.sub(r"sequential[/_]", "", str(p)) for p in npz[paths_key]]
    return {name: npz[f"{prefix}/{i}"] for i, name in enumerate(names)}


def _assert_same_state(actual, expected, what):
    assert list(actual) == list(expected), f"{what}: variables differ"
    assert any("velocity" in name for name in actual), f"{what}: no Adam state: {list(actual)}"
    for name, value in expected.items():
        np.testing.assert_array_equal(actual[name], value, err_msg=f"{what}: {name}")


def _worker_line(output, result):
    match = re.search(r"RESUME WORKER OK .*loss=(\S+) accuracy=(\S+) iterations=(\d+)", output)
    assert match, result.describe()
    return float(match[1]), float(match[2]), int(match[3])


def _spec(mode, directory):
    """A suites.py section: the worker in ``mode`` on ``directory``, labelled ``mode``."""
    return json.dumps({"label": mode, "path": "keras_workers/resume.py",
                       "args": [mode, str(directory)]})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run B (killed), then one job: A (uninterrupted), then the resume of B's
    checkpoint at 2 ranks. Returns A's snapshots, B's checkpoint, and the
    second job with the directory of its resume."""
    root = tmp_path_factory.mktemp("resume")
    full, killed, resumed = root / "full", root / "killed", root / "resumed-np2"
    for directory in (full, killed, resumed):
        directory.mkdir()

    result = run_job(["python", WORKER, "kill", str(killed)], np=2, timeout=JOB_TIMEOUT,
                     env=ENV)
    assert not result.timed_out, result.describe()
    assert result.returncode != 0, result.describe()
    assert f"KILLING rank 1 in epoch {KILL_AFTER + 1}, batch 2" in result.output(1), \
        result.describe()
    assert "RESUME WORKER OK" not in result.stdout, result.describe()
    assert not result.leftovers, result.describe()
    written = sorted(p.name for p in killed.glob("ckpt-*.keras"))
    assert written == [f"ckpt-{e}.keras" for e in range(1, KILL_AFTER + 1)], \
        (written, result.describe())
    checkpoint = killed / f"ckpt-{KILL_AFTER}.keras"

    shutil.copy(checkpoint, resumed)
    both = run_job([sys.executable, str(RUNNER), _spec("full", full), _spec("resume", resumed)],
                   np=2, timeout=2 * JOB_TIMEOUT, env=ENV)
    for rank in range(2):
        suite_output(both, "full", rank)  # A ended well (the resume is its test's to check)
    return {"full": np.load(full / "full-np2.npz"), "checkpoint": checkpoint,
            "both": both, "resumed": resumed}


def _check_resume(runs, directory, np_, outputs, result):
    """The checks of every resume of ``np_`` ranks: ``outputs`` is each rank's."""
    for output in outputs:
        assert (f"resuming from ckpt-{KILL_AFTER}.keras at epoch {KILL_AFTER}, optimizer "
                f"iterations {KILL_AFTER * STEPS}") in output, result.describe()
        assert _worker_line(output, result)[2] == EPOCHS * STEPS, result.describe()
    resumed = np.load(directory / f"resume-np{np_}.npz")
    # What was loaded is exactly what A had after epoch KILL_AFTER: weights,
    # Adam's moments and both iteration counters.
    _assert_same_state(_state(resumed, "loaded", "loaded_paths"),
                       _state(runs["full"], f"epoch{KILL_AFTER}"), "loaded checkpoint")
    return resumed


@pytest.mark.slow
@pytest.mark.timeout(420)  # includes the fixture's two jobs
def test_resume_at_same_size_ends_like_uninterrupted_run(runs):
    both = runs["both"]
    outputs = [suite_output(both, "resume", rank) for rank in range(2)]
    resumed = _check_resume(runs, runs["resumed"], 2, outputs, both)
    for epoch in range(KILL_AFTER + 1, EPOCHS + 1):
        _assert_same_state(_state(resumed, f"epoch{epoch}"),
                           _state(runs["full"], f"epoch{epoch}"), f"after epoch {epoch}")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_resume_at_other_size_trains_on(runs, tmp_path):
    shutil.copy(runs["checkpoint"], tmp_path)
    result = run_job(["python", WORKER, "resume", str(tmp_path)], np=1, timeout=JOB_TIMEOUT,
                     env=ENV)
    result.check()
    resumed = _check_resume(runs, tmp_path, 1, [result.output(0)], result)
    loss, accuracy, _ = _worker_line(result.output(0), result)
    assert math.isfinite(loss) and loss < 0.7, result.describe()
    assert accuracy > 0.75, result.describe()  # 3 classes: chance is about 1/3
    final, expected = _state(resumed, f"epoch{EPOCHS}"), _state(runs["full"], f"epoch{EPOCHS}")
    assert list(final) == list(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(final[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
