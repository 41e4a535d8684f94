"""The rest of Horovod's TensorFlow API at 1, 2 and 3 ranks, under kdrun:
DistributedGradientTape and broadcast_variables in custom training loops
(eager and tf.function), SyncBatchNormalization, DistributedOptimizer's
options (groups, local variables and layers, process sets, accumulation);
alltoall, reducescatter, grouped_allgather and grouped_reducescatter
(ragged and equal splits, a rank sending or receiving nothing, empty inputs,
uneven scatters, scaling, numpy and TF eager / ``tf.function`` / TF1 graph,
gradients, argument errors, mismatches).

Each worker checks every result on every rank against a float64 reference it
computes independently; here each check must be reported passed by every rank.
"""

import re
from pathlib import Path

import pytest

from tests.multiprocess._shared_jobs import HOROVOD_SUITES, TEST_TIMEOUT, suite_output

WORKERS = Path(__file__).with_name("workers")


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("np_", [1, 2, 3])
@pytest.mark.parametrize("worker", sorted(HOROVOD_SUITES))
def test_checks_on_every_rank(worker, np_, tf_job):
    # Every suite in the shared TensorFlow job of np_ ranks (tests/multiprocess/_shared_jobs.py).
    result = tf_job(np_)
    checks = re.findall(r"^def (test_\w+)", (WORKERS / worker).read_text(), flags=re.M)
    assert checks, worker
    for rank in range(np_):
        output = suite_output(result, f"horovod-{worker}", rank)
        for check in checks:
            assert f"{HOROVOD_SUITES[worker]} {check} passed rank={rank}" in output, (
                f"{worker}: {check} on rank {rank}\n{result.describe()}")
