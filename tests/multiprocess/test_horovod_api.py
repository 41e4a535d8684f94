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
import sys
from pathlib import Path

import pytest

from tests._mp import run_job

WORKERS = Path(__file__).with_name("workers")
SUITES = {"tape.py": "TAPE", "sync_batch_norm.py": "SYNCBN", "keras_api.py": "KERASAPI",
          "optimizer_options.py": "OPTOPTS", "exchange.py": "EXCHANGE"}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("np_", [1, 2, 3])
def test_checks_on_every_rank(np_):
    # Every suite in one job (workers/horovod_suites.py): one start-up for all.
    runner = WORKERS / "horovod_suites.py"
    result = run_job([sys.executable, str(runner), *sorted(SUITES)], np=np_, timeout=360,
                     env={"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1",
                          "KERAS_DIST_TIMEOUT_SECONDS": "60"})
    message = result.describe()
    for worker in sorted(SUITES):
        checks = re.findall(r"^def (test_\w+)", (WORKERS / worker).read_text(), flags=re.M)
        assert checks, worker
        for rank in range(np_):
            output = result.output(rank)
            for check in checks:
                assert f"{SUITES[worker]} {check} passed rank={rank}" in output, (
                    f"{worker}: {check} on rank {rank}\n{message}")
    result.check()
