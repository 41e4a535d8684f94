"""The rest of Horovod's TensorFlow API at 1, 2 and 3 ranks, under kdrun:
DistributedGradientTape and broadcast_variables in custom training loops
(eager and tf.function), SyncBatchNormalization, DistributedOptimizer's
options (groups, local variables and layers, process sets, accumulation).

Each worker checks every result on every rank against a float64 reference it
computes independently; here each check must be reported passed by every rank.
"""

import re
from pathlib import Path

import pytest

from tests._mp import run_job

WORKERS = Path(__file__).with_name("workers")
SUITES = {"tape.py": "TAPE", "sync_batch_norm.py": "SYNCBN", "keras_api.py": "KERASAPI",
          "optimizer_options.py": "OPTOPTS"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("np_", [1, 2, 3])
@pytest.mark.parametrize("worker", sorted(SUITES))
def test_checks_on_every_rank(worker, np_):
    path = WORKERS / worker
    checks = re.findall(r"^def (test_\w+)", path.read_text(), flags=re.M)
    assert checks, path
    result = run_job(str(path), np=np_, timeout=240,
                     env={"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"})
    message = result.describe()
    for rank in range(np_):
        output = result.output(rank)
        for check in checks:
            assert f"{SUITES[worker]} {check} passed rank={rank}" in output, (
                f"{check} on rank {rank}\n{message}")
    result.check()
