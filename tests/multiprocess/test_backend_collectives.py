"""Collectives on torch tensors and JAX arrays (eager and jitted) at 2 and 3 ranks."""

import pytest

from tests._mp import run_job

pytest.importorskip("torch", reason="needs torch (the test extra installs it)")
pytest.importorskip("jax", reason="needs jax (the test extra installs it)")
WORKER = "tests/multiprocess/workers/backend_collectives.py"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np_", [2, 3])
def test_torch_and_jax_values_on_every_rank(np_):
    result = run_job(WORKER, np=np_, timeout=120, env={"OMP_NUM_THREADS": "1"},
                     hide=())  # the worker uses JAX and torch values
    result.check()
    for rank in range(np_):
        for kind in ("torch", "jax", "torch gradients", "jit", "native", "native timeline",
                     "native mismatch", "native join", "native plans"):
            assert f"BACKEND COLLECTIVES {kind} ok rank={rank}" in result.output(rank), \
                result.describe()
