"""allreduce / grouped_allreduce with op=Adasum at 1, 2, 3 and 4 ranks, under kdrun.

The worker checks every result on every rank against a float64 reference it
computes itself from every rank's seeded inputs. 2 ranks run everything
(numpy, TF eager / ``tf.function`` / TF1 graph, gradients, the optimizer and
tape, argument errors, a mismatch); 1 and 4 ranks run the numpy checks only
(4 ranks importing TF on a 2-core machine costs ~20 s; the TF paths share the
numpy core); 3 ranks check the NotImplementedError on every rank.
"""

import re
from pathlib import Path

import pytest

from tests._mp import run_job

WORKER = Path(__file__).with_name("workers") / "adasum.py"
TF_QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1",
            "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1",
            "KERAS_DIST_TIMEOUT_SECONDS": "60"}
NUMPY_ONLY = ["test_numpy_allreduce", "test_zero_tensor_on_one_rank",
              "test_grouped_allreduce", "test_shape_mismatch"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_adasum_on_every_rank(np_):
    every = re.findall(r"^def (test_\w+)", WORKER.read_text(), flags=re.M)
    assert set(NUMPY_ONLY) < set(every)
    env = dict(TF_QUIET)
    if np_ == 3:
        checks = ["test_not_power_of_2"]
    elif np_ == 2:
        checks = [name for name in every if name != "test_not_power_of_2"]
    else:
        checks = NUMPY_ONLY
        env["ADASUM_TESTS"] = ",".join(NUMPY_ONLY)
    result = run_job(str(WORKER), np=np_, timeout=160, env=env)
    outputs = [result.output(rank) for rank in range(np_)]
    missing = [(rank, check) for rank, output in enumerate(outputs) for check in checks
               if f"ADASUM {check} passed rank={rank}" not in output]
    missing += [(rank, "OK") for rank, output in enumerate(outputs)
                if f"ADASUM OK rank={rank} size={np_}" not in output]
    assert not missing, f"(rank, check) not passed: {missing}\n{result.describe()}"
    result.check()
