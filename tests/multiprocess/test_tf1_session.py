"""Horovod's TF1 session path (tf.compat.v1) at 1, 2 and 3 ranks, under kdrun.

``BroadcastGlobalVariablesHook`` in ``MonitoredTrainingSession`` (fresh, and
on a session that restores rank 0's checkpoint), ``DistributedOptimizer``
over ``tf.compat.v1.train`` optimizers with its options, and the one-sentence
errors of a graph script that mixes in Keras 3. The worker checks every rank
against one-process graph runs on the global batch; at 2 ranks TensorFlow
runs with ``disable_v2_behavior()``, at 1 and 3 with
``disable_eager_execution()`` only. Then the TF1 MNIST example at 2 ranks,
in the same job as the 2-rank checks, after them (``workers/suites.py``: one
start of TensorFlow for both, each read from its own section of the output;
both run TensorFlow with ``disable_v2_behavior()``), when that test runs;
each section runs only when its own test does (the slow MNIST test alone,
as CI's second command runs it, starts no session checks).
"""

import json
import re
import sys

import pytest

from tests._mp import REPO_ROOT, run_job
from tests.multiprocess._shared_jobs import RUNNER, suite_output

WORKER = "tests/multiprocess/workers/tf1_session.py"
TF_QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1",
            "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}
CHECKS = ["test_graph_building_leaves_the_eager_runtime_alone",
          "test_monitored_training_session_matches_one_process",
          "test_hook_broadcasts_the_restored_checkpoint",
          "test_compute_gradients_reduces_with_every_option",
          "test_backward_passes_and_momentum_slots",
          "test_mixing_in_keras_3_is_one_sentence"]
JOB_TIMEOUT, MNIST_TIMEOUT = 260, 170
MNIST = "test_tf1_mnist_example_ends_alike_on_two_ranks"
SESSION_AT_2 = "test_tf1_session_path_on_every_rank[2]"


def _env(np_, checkpoints):
    # At 3 ranks, two virtual machines (2 + 1 ranks), as test_tf_api.
    per_node = {"KERAS_DIST_RANKS_PER_NODE": "2"} if np_ == 3 else {}
    return {**per_node, "KERAS_DIST_TIMEOUT_SECONDS": "60",
            "TF1_MODE": "v1" if np_ == 2 else "eager_off", "TF1_CHECKPOINTS": str(checkpoints)}


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory):
    """The job of 2 ranks: the worker's checks (section "session"), when this
    session runs the 2-rank test, then, when it runs the MNIST test, the
    example (section "mnist", in the job's working directory). Returns the
    result and both directories."""
    checkpoints = tmp_path_factory.mktemp("tf1-session")
    example = tmp_path_factory.mktemp("tf1-mnist")
    selected = {item.name for item in request.session.items}
    specs = []
    if SESSION_AT_2 in selected:
        specs.append({"label": "session", "path": WORKER.removeprefix("tests/multiprocess/"),
                      "env": _env(2, checkpoints)})
    if MNIST in selected:
        # examples/tensorflow_v1: Horovod's TF1 MNIST recipe, 10 steps a rank,
        # on the shipped digits.
        specs.append({"label": "mnist",
                      "path": str(REPO_ROOT / "examples" / "tensorflow_v1" / "train.py"),
                      "args": ["--steps", "20", "--checkpoint-dir", "checkpoints"]})
    result = run_job([sys.executable, str(RUNNER), *map(json.dumps, specs)], np=2,
                     timeout=JOB_TIMEOUT + MNIST_TIMEOUT * (MNIST in selected), env=TF_QUIET,
                     cwd=example)
    return result, checkpoints, example


def _check_session(outputs, result, np_, checkpoints):
    for rank, output in enumerate(outputs):
        for check in CHECKS:
            assert f"TF1 {check} passed rank={rank}" in output, result.describe()
        assert f"TF1 SESSION OK rank={rank} size={np_}" in output, result.describe()
    # Only rank 0 was given a checkpoint directory, and it wrote there.
    assert any(p.name == "checkpoint" for p in (checkpoints / "run").iterdir())


def _section(result, label, rank):
    """Rank ``rank``'s output of section ``label`` so far (all of it if it did not end)."""
    stdout = result.rank_stdout.get(rank, "")
    begins = re.search(rf"^SUITE {label} begins rank=\S+$", stdout, flags=re.M)
    return "" if begins is None else stdout[begins.end():]


@pytest.mark.timeout(JOB_TIMEOUT + MNIST_TIMEOUT + 40)  # the 2-rank job may run the example
@pytest.mark.parametrize("np_", [1, 2, 3])
def test_tf1_session_path_on_every_rank(np_, tmp_path, request):
    if np_ == 2:
        result, checkpoints, _ = request.getfixturevalue("two_ranks")
        # Each check by name first (a failed one reported as such), then the section's end.
        _check_session([_section(result, "session", rank) for rank in range(2)], result, 2,
                       checkpoints)
        for rank in range(2):
            suite_output(result, "session", rank)
        return
    result = run_job(WORKER, np=np_, timeout=JOB_TIMEOUT, env={**TF_QUIET, **_env(np_, tmp_path)})
    result.check()
    _check_session([result.output(rank) for rank in range(np_)], result, np_, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT + MNIST_TIMEOUT + 40)
def test_tf1_mnist_example_ends_alike_on_two_ranks(two_ranks):
    result, _, example = two_ranks
    outputs = [suite_output(result, "mnist", rank) for rank in range(2)]
    reports = [re.search(r"rank \d: test accuracy ([\d.]+), weights digest (\w+)", output)
               for output in outputs]
    assert all(reports), result.describe()
    assert reports[0].group(2) == reports[1].group(2), result.describe()  # identical weights
    assert float(reports[0].group(1)) > 0.5, result.describe()  # far above chance (0.1)
    # Rank 0 alone wrote: one event file, the checkpoints of steps 0 and 10.
    written = example / "checkpoints"
    assert [p.name for p in example.iterdir()] == ["checkpoints"]
    assert len(list(written.glob("events.out.tfevents.*"))) == 1, sorted(written.iterdir())
    assert (written / "model.ckpt-10.index").exists(), sorted(written.iterdir())
