"""keras_dist's TensorFlow ops on 2 ranks: allreduce results against float64,
allgathers against every rank's rows, the numpy path's bits, mismatches, a
bucket larger than the shm buffer, the timeline."""

import re
from pathlib import Path

import pytest

from tests.multiprocess._shared_jobs import TEST_TIMEOUT, suite_output

WORKER = Path(__file__).with_name("workers") / "tf_kernel.py"


@pytest.mark.timeout(TEST_TIMEOUT)
def test_the_op_on_every_rank(tf_job):
    # In the shared TensorFlow job of 2 ranks, on the shm engine with 1 MiB
    # slots (tests/multiprocess/_shared_jobs.py).
    checks = re.findall(r"^def (test_\w+)", WORKER.read_text(), flags=re.M)
    result = tf_job(2)
    for rank in range(2):
        output = suite_output(result, "tf_kernel", rank)
        for check in checks:
            assert f"TFOP {check} passed rank={rank}" in output, (
                f"{check} on rank {rank}\n{result.describe()}")
