"""GPU (cupy) allreduce on real GPUs, through NCCL and staged through the host
(KERAS_DIST_GPU_OPERATIONS). Skipped, and says why, without cupy, NCCL or a GPU."""

import pytest

from tests._mp import run_job
from tests.gpu._gpu import cupy_with_a_gpu, gpu_count

cupy = cupy_with_a_gpu()

WORKER = r"""
import os, numpy as np, cupy
import keras_dist as kd
kd.init()
r, n = kd.rank(), kd.size()
cupy.cuda.Device(kd.local_rank() % cupy.cuda.runtime.getDeviceCount()).use()
for dtype in (np.float16, np.float32, np.float64, np.int32, np.int64):
    inputs = [np.random.default_rng([9, k]).integers(-50, 50, 1001).astype(dtype)
              for k in range(n)]
    got = kd.allreduce(cupy.asarray(inputs[r]), op=kd.Sum)
    assert isinstance(got, cupy.ndarray) and got.dtype == dtype
    assert got.device.id == cupy.cuda.Device().id
    ref = np.sum([i.astype(np.float64) for i in inputs], axis=0)
    assert np.allclose(cupy.asnumpy(got).astype(np.float64), ref, rtol=1e-3), dtype
floats = [np.random.default_rng([10, k]).standard_normal(257) for k in range(n)]
got = kd.grouped_allreduce([cupy.asarray(floats[r])], op=kd.Average, prescale_factor=0.5)[0]
assert np.allclose(cupy.asnumpy(got), np.mean(floats, axis=0) * 0.5, rtol=1e-12)
name = kd._get().gpu_transport.name  # made at one rank too: the shortcut is off
assert name.startswith(os.environ["EXPECTED_TRANSPORT"]), name
from keras_dist.tensor.ops import COUNTERS
assert COUNTERS["gpu_allreduce"] >= 6, COUNTERS
print("GPU ALLREDUCE OK", r, flush=True)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("operations, np_, gpus_needed, expected", [
    ("nccl", 1, 1, "nccl"),
    ("nccl", 2, 2, "nccl"),  # NCCL puts one rank on each GPU
    ("auto", 2, 2, "nccl"),
    ("mpi", 2, 1, "host-staged"),  # host staging lets ranks share a GPU
])
def test_gpu_allreduce_matches_numpy(operations, np_, gpus_needed, expected):
    if gpu_count(cupy) < gpus_needed:
        pytest.skip(f"needs {gpus_needed} GPUs; {gpu_count(cupy)} visible")
    result = run_job(["python", "-c", WORKER], np=np_, timeout=150,
                     env={"KERAS_DIST_GPU_OPERATIONS": operations,
                          "KERAS_DIST_SIZE_ONE_SHORTCUT": "0",
                          "EXPECTED_TRANSPORT": expected})
    result.check()
    for rank in range(np_):
        assert f"GPU ALLREDUCE OK {rank}" in result.output(rank), result.describe()
