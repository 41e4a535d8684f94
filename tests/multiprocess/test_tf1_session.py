"""Horovod's TF1 session path (tf.compat.v1) at 1, 2 and 3 ranks, under kdrun.

``BroadcastGlobalVariablesHook`` in ``MonitoredTrainingSession`` (fresh, and
on a session that restores rank 0's checkpoint), ``DistributedOptimizer``
over ``tf.compat.v1.train`` optimizers with its options, and the one-sentence
errors of a graph script that mixes in Keras 3. The worker checks every rank
against one-process graph runs on the global batch; at 2 ranks TensorFlow
runs with ``disable_v2_behavior()``, at 1 and 3 with
``disable_eager_execution()`` only. Then the TF1 MNIST example at 2 ranks.
"""

import re
import sys

import pytest

from tests._mp import REPO_ROOT, run_job

WORKER = "tests/multiprocess/workers/tf1_session.py"
TF_QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1",
            "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}
CHECKS = ["test_graph_building_leaves_the_eager_runtime_alone",
          "test_monitored_training_session_matches_one_process",
          "test_hook_broadcasts_the_restored_checkpoint",
          "test_compute_gradients_reduces_with_every_option",
          "test_backward_passes_and_momentum_slots",
          "test_mixing_in_keras_3_is_one_sentence"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("np_", [1, 2, 3])
def test_tf1_session_path_on_every_rank(np_, tmp_path):
    # At 3 ranks, two virtual machines (2 + 1 ranks), as test_tf_api.
    per_node = {"KERAS_DIST_RANKS_PER_NODE": "2"} if np_ == 3 else {}
    env = {**TF_QUIET, **per_node, "KERAS_DIST_TIMEOUT_SECONDS": "60",
           "TF1_MODE": "v1" if np_ == 2 else "eager_off", "TF1_CHECKPOINTS": str(tmp_path)}
    result = run_job(WORKER, np=np_, timeout=260, env=env)
    result.check()
    for rank in range(np_):
        output = result.output(rank)
        for check in CHECKS:
            assert f"TF1 {check} passed rank={rank}" in output, result.describe()
        assert f"TF1 SESSION OK rank={rank} size={np_}" in output, result.describe()
    # Only rank 0 was given a checkpoint directory, and it wrote there.
    assert any(p.name == "checkpoint" for p in (tmp_path / "run").iterdir())


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_tf1_mnist_example_ends_alike_on_two_ranks(tmp_path):
    # examples/tensorflow_v1: Horovod's TF1 MNIST recipe, 10 steps a rank, on
    # the shipped digits.
    command = [sys.executable, str(REPO_ROOT / "examples" / "tensorflow_v1" / "train.py"),
               "--steps", "20", "--checkpoint-dir", "checkpoints"]
    result = run_job(command, np=2, timeout=170, env=TF_QUIET, cwd=tmp_path)
    result.check()
    reports = [re.search(r"rank \d: test accuracy ([\d.]+), weights digest (\w+)",
                         result.output(rank)) for rank in range(2)]
    assert all(reports), result.describe()
    assert reports[0].group(2) == reports[1].group(2), result.describe()  # identical weights
    assert float(reports[0].group(1)) > 0.5, result.describe()  # far above chance (0.1)
    # Rank 0 alone wrote: one event file, the checkpoints of steps 0 and 10.
    written = tmp_path / "checkpoints"
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoints"]
    assert len(list(written.glob("events.out.tfevents.*"))) == 1, sorted(written.iterdir())
    assert (written / "model.ckpt-10.index").exists(), sorted(written.iterdir())
