"""keras_dist's TensorFlow ops on 2 ranks: allreduce results against float64,
allgathers against every rank's rows, the numpy path's bits, mismatches, a
bucket larger than the shm buffer, the timeline."""

import re
from pathlib import Path

import pytest

from tests._mp import run_job

WORKER = Path(__file__).with_name("workers") / "tf_kernel.py"


@pytest.mark.timeout(200)
def test_the_op_on_every_rank():
    checks = re.findall(r"^def (test_\w+)", WORKER.read_text(), flags=re.M)
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1",
           "KERAS_DIST_TIMEOUT_SECONDS": "60", "KERAS_DIST_CPU_OPERATIONS": "shm",
           # 1 MiB slots: the 1.2 MB tensor's bucket goes in windows.
           "KERAS_DIST_SHM_SLOT_BYTES": str(1 << 20)}
    result = run_job(str(WORKER), np=2, timeout=150, env=env)
    message = result.describe()
    for rank in range(2):
        for check in checks:
            assert f"TFOP {check} passed rank={rank}" in result.output(rank), (
                f"{check} on rank {rank}\n{message}")
    result.check()
