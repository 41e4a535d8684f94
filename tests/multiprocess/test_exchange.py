"""alltoall, reducescatter, grouped_allgather and grouped_reducescatter at 1, 2 and
3 ranks, under kdrun.

The worker checks every result on every rank against float64 references it
computes itself (ragged and equal splits, a rank sending or receiving
nothing, empty inputs, uneven scatters, scaling, numpy and TF eager /
``tf.function`` / TF1 graph, gradients, argument errors, mismatches); here
every rank must report every check passed.
"""

import re
from pathlib import Path

import pytest

from tests._mp import run_job

WORKER = Path(__file__).with_name("workers") / "exchange.py"
TF_QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1",
            "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("np_", [1, 2, 3])
def test_exchange_collectives_on_every_rank(np_):
    checks = re.findall(r"^def (test_\w+)", WORKER.read_text(), flags=re.M)
    assert checks
    result = run_job(str(WORKER), np=np_, timeout=360,
                     env={**TF_QUIET, "KERAS_DIST_TIMEOUT_SECONDS": "60"})
    message = result.describe()
    for rank in range(np_):
        output = result.output(rank)
        for check in checks:
            assert f"EXCHANGE {check} passed rank={rank}" in output, \
                f"{check} rank {rank}\n{message}"
        assert f"EXCHANGE OK rank={rank} size={np_}" in output, message
    result.check()
