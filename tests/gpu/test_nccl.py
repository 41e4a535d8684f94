"""NCCL transport on real GPUs. Skipped, and says why, without cupy, NCCL or a GPU."""

import pytest

from tests._mp import run_job

cupy = pytest.importorskip("cupy", reason="needs cupy (pip install 'keras-dist[cuda12]')")


def _gpu_count() -> int:
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - a CUDA driver error means no usable GPU
        return 0


pytestmark = pytest.mark.skipif(_gpu_count() == 0, reason="needs a CUDA GPU; none is visible")

WORKER = r"""
import numpy as np, cupy
import keras_dist as kd
kd.init()
r, n = kd.rank(), kd.size()
for dtype in (np.float16, np.float32, np.float64, np.int32, np.int64):
    inputs = [np.random.default_rng([9, k]).integers(-50, 50, 1001).astype(dtype)
              for k in range(n)]
    got = kd.allreduce(cupy.asarray(inputs[r]), op=kd.Sum)
    assert isinstance(got, cupy.ndarray) and got.dtype == dtype
    ref = np.sum([i.astype(np.float64) for i in inputs], axis=0)
    assert np.allclose(cupy.asnumpy(got).astype(np.float64), ref, rtol=1e-3), dtype
print("NCCL OK", r, flush=True)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np_", [1, 2])
def test_nccl_allreduce_matches_numpy(np_):
    if _gpu_count() < np_:
        pytest.skip(f"needs {np_} GPUs (NCCL puts one rank on each); {_gpu_count()} visible")
    result = run_job(["python", "-c", WORKER], np=np_, timeout=150)
    result.check()
    for rank in range(np_):
        assert f"NCCL OK {rank}" in result.output(rank), result.describe()
