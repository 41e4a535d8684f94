"""DistributedOptimizer(shard_optimizer_state=True) at 2 ranks on TensorFlow, JAX and
PyTorch (see workers/sharded_optimizer.py): every Keras optimizer and the wrapper's
options against the unsharded DistributedOptimizer, each rank's share of the state,
and fit with BroadcastGlobalVariablesCallback. At 1 and 3 ranks (shares that do not
divide evenly) on PyTorch, the cheapest backend to start, with the JAX subset of
optimizers and every option. The weights' exchange runs in buckets of a few variables."""

import pytest

from tests._mp import run_job

WORKER = "tests/multiprocess/workers/sharded_optimizer.py"
# A fusion threshold of 256 bytes: the weights' exchange runs in several buckets
# (zero.Shards.exchange), a few variables each, the first one alone.
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1", "SHARDED_STEPS": "10",
       "KERAS_DIST_FUSION_THRESHOLD": "256"}
# Every Keras optimizer on TensorFlow and PyTorch; on JAX (a jit compile each, the
# slowest) one element-wise and the shape-dependent ones, with every option.
SWEEPS = {"tensorflow": "", "torch": "", "jax": "sgd_nesterov,lamb,adafactor,muon"}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("backend", "np_"), [("tensorflow", 2), ("jax", 2), ("torch", 2),
                                           ("torch", 1), ("torch", 3)],
                         ids=["tensorflow", "jax", "torch", "torch-1", "torch-3"])
def test_sharded_optimizer_matches_the_unsharded_one(backend, np_):
    sweep = SWEEPS[backend] if np_ == 2 else SWEEPS["jax"]
    result = run_job(WORKER, np=np_, timeout=560, env={
        **ENV, "KERAS_BACKEND": backend, "SHARDED_OPTIMIZERS": sweep})
    result.check()
    for rank in range(np_):
        assert f"SHARDED OK rank={rank}" in result.output(rank), result.describe()
