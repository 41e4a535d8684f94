"""allreduce / grouped_allreduce with op=Adasum at 1, 2, 3 and 4 ranks, under kdrun.

The worker checks every result on every rank against a float64 reference it
computes itself from every rank's seeded inputs. 2 ranks run everything
(numpy, TF eager / ``tf.function`` / TF1 graph, gradients, the optimizer and
tape, argument errors, a mismatch); 1 and 4 ranks run the numpy checks only
(the TF paths share the numpy core, and 4 ranks importing TF oversubscribe
this 2-core machine); 3 ranks check the NotImplementedError on every rank.
1, 2 and 3 ranks run in the shared TensorFlow job of their size
(tests/multiprocess/_shared_jobs.py).
"""

import re
from pathlib import Path

import pytest

from tests._mp import run_job
from tests.multiprocess._shared_jobs import (
    ADASUM_NUMPY_ONLY,
    BOUNDED,
    ENV,
    TEST_TIMEOUT,
    suite_output,
)

WORKER = Path(__file__).with_name("workers") / "adasum.py"


def _checks(np_: int) -> list[str]:
    every = re.findall(r"^def (test_\w+)", WORKER.read_text(), flags=re.M)
    assert set(ADASUM_NUMPY_ONLY) < set(every)
    if np_ == 3:
        return ["test_not_power_of_2"]
    if np_ == 2:
        return [name for name in every if name != "test_not_power_of_2"]
    return ADASUM_NUMPY_ONLY


def _missing(outputs: list[str], np_: int) -> list[tuple[int, str]]:
    missing = [(rank, check) for rank, output in enumerate(outputs) for check in _checks(np_)
               if f"ADASUM {check} passed rank={rank}" not in output]
    return missing + [(rank, "OK") for rank, output in enumerate(outputs)
                      if f"ADASUM OK rank={rank} size={np_}" not in output]


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("np_", [1, 2, 3])
def test_adasum_on_every_rank(np_, tf_job):
    # In the shared TensorFlow job of np_ ranks (tests/multiprocess/_shared_jobs.py).
    result = tf_job(np_)
    outputs = [suite_output(result, "adasum", rank) for rank in range(np_)]
    missing = _missing(outputs, np_)
    assert not missing, f"(rank, check) not passed: {missing}\n{result.describe()}"


@pytest.mark.timeout(200)
def test_adasum_numpy_checks_on_four_ranks():
    result = run_job(str(WORKER), np=4, timeout=160,
                     env={**ENV, **BOUNDED, "ADASUM_TESTS": ",".join(ADASUM_NUMPY_ONLY)})
    missing = _missing([result.output(rank) for rank in range(4)], 4)
    assert not missing, f"(rank, check) not passed: {missing}\n{result.describe()}"
    result.check()
