"""The Keras layer at 1, 2 and 3 ranks under kdrun (see keras_workers/train_checks.py),
on TensorFlow; on JAX at 1 and 2 ranks and PyTorch at 2 (the same checks, less the
TensorFlow-only ones, which the worker names).

The worker checks on every rank: exactness against a float64 numpy SGD with
the global batch (ranks starting from different weights), the number of
allreduce calls, backward_passes_per_step, fp16 compression, the predivide
factor, sparse gradients both ways, the four callbacks, a float16 overflow
on one rank only under mixed_float16, jit_compile=True, and save/load/resume.
"""

import pytest

from tests._mp import run_job

WORKER = "tests/multiprocess/keras_workers/train_checks.py"
# The default transport (shared memory on one machine), as a user gets it.
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}
# The JAX and PyTorch jobs' ranks start as on an install of that framework
# alone: with TensorFlow installed, keras.utils.set_random_seed imports it to
# seed it too (seconds of CPU a rank). TensorFlow's job hides JAX (tests/_mp.py's
# default).
HIDDEN = {"jax": ("tensorflow", "torch", "matplotlib"),
          "torch": ("tensorflow", "jax", "jaxlib", "matplotlib")}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend,np_", [("tensorflow", 1), ("tensorflow", 2),
                                         ("tensorflow", 3), ("jax", 1), ("jax", 2),
                                         ("torch", 2)])
def test_keras_layer_on_every_rank(backend, np_):
    result = run_job(WORKER, np=np_, timeout=260, env={**ENV, "KERAS_BACKEND": backend},
                     hide=HIDDEN.get(backend))
    result.check()
    for rank in range(np_):
        assert f"KERAS CHECKS OK rank={rank} size={np_}" in result.output(rank), \
            result.describe()
