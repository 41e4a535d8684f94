"""BackupAndRestore on several ranks (issue 11, item 3), with keras_workers/backup.py.

Each rank's backup directory is its own (``DIR/host<rank>/backup``), as on
hosts with no shared file system, so the file system itself shows who wrote.

- A: 2 ranks, uninterrupted (``kd.callbacks.BackupAndRestore``).
- B: 2 ranks, a plain ``keras.callbacks.BackupAndRestore``; rank 1 SIGKILLs
  itself at the second batch of epoch 2, after rank 0's backup of epoch 1;
  kdrun fails and only ``host0/backup`` exists, holding epoch 2.
- The same command as B, run again: every rank starts at epoch 2 with
  iterations 12 and A's state after epoch 2, and ends with A's final state,
  bit for bit (same data order, same kernels single-threaded, float32 values
  stored exactly in the h5 file); rank 0 deletes the backup; no other rank
  ever had one.
- B's backup at 1 rank and at 3 ranks (same global batch): every rank
  starts from A's state after epoch 2 bit for bit, and ends with the same
  state as the others and 24 iterations; the result equals A's up to float32
  rounding (the mean gradient over 24 samples summed in another order).

B runs first; then A and B's command again one after another in one job of
2 ranks (``workers/suites.py``: one start of TensorFlow for both, each read
from its own section of the output; the worker clears Keras's session before
it builds its model, so its variables have the same names there as alone);
then the 1- and 3-rank resumes at once.
"""

import json
import re
import shutil
import sys

import numpy as np
import pytest

from tests._mp import start_job
from tests.multiprocess._shared_jobs import RUNNER, suite_output
from tests.multiprocess.test_resume import _assert_same_state

WORKER = "tests/multiprocess/keras_workers/backup.py"
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}
EPOCHS, STEPS, KILL_EPOCH = 4, 6, 2  # as in the worker and the command below
JOB_TIMEOUT = 90


def _arguments(directory, kind, kill=False):
    return [str(directory), kind, *(["--kill-epoch", str(KILL_EPOCH)] * kill)]


def _command(directory, kind, kill=False):
    return ["python", WORKER, *_arguments(directory, kind, kill)]


def _spec(label, directory, kind, kill=False):
    """A suites.py section: the worker with ``_command``'s arguments, labelled ``label``."""
    return json.dumps({"label": label, "path": "keras_workers/backup.py",
                       "args": _arguments(directory, kind, kill)})


def _wait_all(jobs, timeout=JOB_TIMEOUT):
    try:
        return [job.wait(timeout) for job in jobs]
    finally:
        for job in jobs:
            job.kill()


def _state(npz, prefix):
    return {str(path): npz[f"{prefix}/{i}"] for i, path in enumerate(npz["paths"])}


def _outputs(result, size):
    return [result.output(rank) for rank in range(size)]


def _start_lines(outputs, result):
    """Each rank's (epoch, iterations, digest) when its fit began; the same on all ranks.
    ``outputs``: each rank's output (of ``result``)."""
    found = []
    for output in outputs:
        match = re.search(r"fit starts at epoch (\d+), optimizer iterations (\d+), state (\w+)",
                          output)
        assert match, result.describe()
        found.append((int(match[1]), int(match[2]), match[3]))
    assert all(entry == found[0] for entry in found), (found, result.describe())
    return found[0]


def _end_digest(outputs, result):
    digests = set()
    for rank, output in enumerate(outputs):
        match = re.search(rf"BACKUP WORKER OK rank {rank} size {len(outputs)}: optimizer "
                          rf"iterations {EPOCHS * STEPS}, state (\w+)", output)
        assert match, result.describe()
        digests.add(match[1])
    assert len(digests) == 1, (digests, result.describe())
    return digests.pop()


@pytest.fixture(scope="module")
def first_runs(tmp_path_factory):
    """B, then one job: A, then B's command again. Returns A's snapshots and
    final digest, B's directory, a copy of B's backup, and the second job."""
    root = tmp_path_factory.mktemp("backup")
    full, killed, saved = root / "full", root / "killed", root / "saved"
    full.mkdir()
    killed.mkdir()
    killed_result = _wait_all([start_job(_command(killed, "keras", kill=True), np=2, env=ENV)])[0]
    assert not killed_result.timed_out, killed_result.describe()
    assert killed_result.returncode != 0, killed_result.describe()
    assert f"KILLING rank 1 in epoch {KILL_EPOCH}, batch 1" in killed_result.output(1), \
        killed_result.describe()
    assert not killed_result.leftovers, killed_result.describe()
    # One writer: rank 0's directory alone exists, and holds the last epoch's backup.
    assert sorted(p.parent.name for p in killed.glob("host*/backup")) == ["host0"], \
        killed_result.describe()
    backup = killed / "host0" / "backup"
    assert sorted(p.name for p in backup.iterdir()) == \
        ["latest.weights.h5", "training_metadata.json"]
    assert f'"epoch": {KILL_EPOCH}' in (backup / "training_metadata.json").read_text()
    shutil.copytree(backup, saved)

    both = start_job([sys.executable, str(RUNNER), _spec("full", full, "kd"),
                      _spec("again", killed, "keras", kill=True)], np=2, env=ENV)
    both = _wait_all([both], 2 * JOB_TIMEOUT)[0]
    full_outputs = [suite_output(both, "full", rank) for rank in range(2)]
    return {"full": np.load(full / "result-np2.npz"),
            "full_digest": _end_digest(full_outputs, both),
            "both": both, "killed": killed, "saved": saved}


@pytest.mark.slow
@pytest.mark.timeout(340)  # includes the fixture's jobs
def test_same_command_again_resumes_on_every_rank_bit_for_bit(first_runs):
    killed, result = first_runs["killed"], first_runs["both"]
    outputs = [suite_output(result, "again", rank) for rank in range(2)]
    assert not any("KILLING" in output for output in outputs), result.describe()
    epoch, iterations, _ = _start_lines(outputs, result)
    assert (epoch, iterations) == (KILL_EPOCH, KILL_EPOCH * STEPS), result.describe()
    assert _end_digest(outputs, result) == first_runs["full_digest"]
    resumed, full = np.load(killed / "result-np2.npz"), first_runs["full"]
    _assert_same_state(_state(resumed, "loaded"), _state(full, f"epoch{KILL_EPOCH}"),
                       "restored state")
    for done in range(KILL_EPOCH + 1, EPOCHS + 1):
        _assert_same_state(_state(resumed, f"epoch{done}"), _state(full, f"epoch{done}"),
                           f"after epoch {done}")
    # Rank 0 deleted its backup at the end; no other rank ever wrote one.
    assert not list(killed.glob("host*/backup")), list(killed.rglob("*"))
    assert [p.name for p in killed.glob("host*")] == ["host0"]


@pytest.fixture(scope="module")
def other_sizes(first_runs, tmp_path_factory):
    """B's backup resumed at 1 rank and at 3 ranks, at once."""
    directories = {}
    for size in (1, 3):
        directory = tmp_path_factory.mktemp(f"resume-np{size}")
        shutil.copytree(first_runs["saved"], directory / "host0" / "backup")
        directories[size] = directory
    results = _wait_all([start_job(_command(directories[1], "kd"), np=1, env=ENV),
                         start_job(_command(directories[3], "keras"), np=3, env=ENV)])
    return {size: (directories[size], result) for size, result in zip((1, 3), results)}


@pytest.mark.parametrize("size", [1, 3])
@pytest.mark.slow
@pytest.mark.timeout(340)
def test_backup_of_two_ranks_resumes_at_another_size(first_runs, other_sizes, size):
    directory, result = other_sizes[size]
    result.check()
    epoch, iterations, _ = _start_lines(_outputs(result, size), result)
    assert (epoch, iterations) == (KILL_EPOCH, KILL_EPOCH * STEPS), result.describe()
    # Every rank ends with the same state and all iterations.
    _end_digest(_outputs(result, size), result)
    resumed, full = np.load(directory / f"result-np{size}.npz"), first_runs["full"]
    _assert_same_state(_state(resumed, "loaded"), _state(full, f"epoch{KILL_EPOCH}"),
                       "restored state")
    final, expected = _state(resumed, f"epoch{EPOCHS}"), _state(full, f"epoch{EPOCHS}")
    assert list(final) == list(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(final[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    assert not list(directory.glob("host*/backup")), "rank 0 deletes the backup at the end"
    assert [p.name for p in directory.glob("host*")] == ["host0"]


@pytest.mark.slow
@pytest.mark.timeout(340)
def test_kdrun_max_restarts_relaunches_a_plain_fit_script(first_runs, tmp_path):
    """The README recipe: one kdrun command; rank 1 dies in epoch 2, kdrun
    relaunches, every rank resumes from rank 0's backup and ends with A's state."""
    job = start_job(_command(tmp_path, "keras", kill=True), np=2, env=ENV,
                    kdrun_args=["--max-restarts", "1"])
    result = _wait_all([job])[0]
    result.check()
    assert not result.leftovers, result.describe()
    assert f"KILLING rank 1 in epoch {KILL_EPOCH}, batch 1" in result.stdout, result.describe()
    assert "rank 1 failed; restarting (restart 1 of 1)" in result.launcher_stderr, (
        result.describe())
    assert _end_digest(_outputs(result, 2), result) == first_runs["full_digest"]
    assert not list(tmp_path.glob("host*/backup")), "rank 0 deletes the backup at the end"
