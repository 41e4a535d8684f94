"""DistributedGradientTape and broadcast_variables in custom training loops
(eager and tf.function), at 1, 2 and 3 ranks, under kdrun.

The worker checks every gradient on every rank against the float64 mean of
every rank's plain gradients; here each check must be reported passed by
every rank.
"""

import re

import pytest

from tests._mp import run_job

WORKER = "tests/multiprocess/workers/tape.py"
CHECKS = re.findall(r"^def (test_\w+)", open(WORKER).read(), flags=re.M)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("np_", [1, 2, 3])
def test_tape_checks_on_every_rank(np_):
    result = run_job(WORKER, np=np_, timeout=240,
                     env={"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"})
    message = result.describe()
    for rank in range(np_):
        output = result.output(rank)
        for check in CHECKS:
            assert f"TAPE {check} passed rank={rank}" in output, (
                f"{check} on rank {rank}\n{message}")
    result.check()
