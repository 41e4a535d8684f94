"""Saving and resuming a DistributedOptimizer(shard_optimizer_state=True) run on
TensorFlow, JAX and PyTorch (see workers/sharded_saving.py): saving on rank 0 alone
raises at once there and hangs nothing; kd.save_model on every rank writes the whole
state in the unsharded layout; the file loaded at 2 ranks and at 3 (uneven shares),
sharded and unsharded, continues to the weights of the uninterrupted run;
BackupAndRestore's backup of a 2-rank run resumes at 3 ranks exactly, and
BestModelCheckpoint on every rank writes the whole state."""

import pytest

from tests._mp import run_job

WORKER = "tests/multiprocess/workers/sharded_saving.py"
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}
# The JAX and PyTorch jobs' ranks start as on an install of that framework alone
# (Keras imports JAX and matplotlib where installed, and TensorFlow at a save:
# seconds of CPU a rank); TensorFlow's job hides JAX (tests/_mp.py's default).
HIDDEN = {"jax": ("tensorflow", "torch", "matplotlib"),
          "torch": ("tensorflow", "jax", "jaxlib", "matplotlib")}
SAVE_CHECKS = ["check_save_whole", "check_load_sharded", "check_best_model_checkpoint",
               "check_backup_written", "check_rank_zero_save_raises",
               "check_rank_zero_checkpoint_raises"]
LOAD_CHECKS = ["check_load_sharded", "check_load_unsharded", "check_backup_resumed"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_sharded_run_saves_whole_and_resumes_at_another_size(backend, tmp_path):
    env = {**ENV, "KERAS_BACKEND": backend, "SAVING_DIR": str(tmp_path),
           "JAX_ENABLE_X64": "1"}  # float64 on JAX
    saved = run_job(["python", WORKER, "save"], np=2, timeout=280, env=env,
                    hide=HIDDEN.get(backend))
    saved.check()
    for rank in range(2):
        for check in SAVE_CHECKS:
            assert f"SAVING {check} passed rank={rank}" in saved.output(rank), saved.describe()
    assert "rank 0 refused" in saved.output(0), saved.describe()
    loaded = run_job(["python", WORKER, "load"], np=3, timeout=280, env=env,
                     hide=HIDDEN.get(backend))
    loaded.check()
    for rank in range(3):
        for check in LOAD_CHECKS:
            assert f"SAVING {check} passed rank={rank}" in loaded.output(rank), loaded.describe()
