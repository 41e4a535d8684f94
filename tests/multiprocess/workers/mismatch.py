"""Ranks call mismatched collectives on purpose; every rank must get an error.

Usage: mismatch.py SCENARIO [SCENARIO ...] (or ``all``). Rank 0 and the other
ranks disagree in the way each scenario names. For each scenario, each rank
prints "MISMATCH rank=R scenario=S: <message>" when it gets the error, or
"NO ERROR rank=R scenario=S" (a failure) when the call returned. Several
scenarios run one after another in one job, as workers/_checks.py checks: the
group stays usable after a mismatch (workers/recovery.py checks that), and
the ranks agree on each outcome before the next scenario starts.
"""

import sys

import numpy as np

import keras_dist as kd
from tests.multiprocess.workers._checks import run_checks

kd.init()
RANK = kd.rank()
first = RANK == 0
x = np.random.default_rng(RANK).standard_normal(12).astype(np.float32)

SCENARIOS = {
    "shape": lambda: kd.allreduce(x[:10] if first else x[:12]),
    "same_count_other_shape": lambda: kd.allreduce(x.reshape(3, 4) if first else x.reshape(4, 3)),
    "dtype": lambda: kd.allreduce(x if first else x.astype(np.float64)),
    "op": lambda: kd.allreduce(x, op=kd.Sum if first else kd.Max),
    "grouped_count": lambda: kd.grouped_allreduce([x[:4], x[4:]] if first else [x]),
    "order": lambda: kd.allreduce(x) if first else kd.broadcast(x, root_rank=0),
    "root": lambda: kd.broadcast(x, root_rank=0 if first else 1),
    "allgather_shape": lambda: kd.allgather(x.reshape(3, 4) if first else x.reshape(2, 6)),
}



def scenario_check(scenario):
    def check():
        try:
            SCENARIOS[scenario]()
        except (kd.CollectiveMismatchError, ValueError) as error:
            print(f"MISMATCH rank={RANK} scenario={scenario}: {type(error).__name__}: {error}",
                  flush=True)
            return
        print(f"NO ERROR rank={RANK} scenario={scenario}", flush=True)
        raise AssertionError(f"{scenario}: the mismatched call returned on rank {RANK}")

    check.__name__ = scenario
    return check


chosen = list(SCENARIOS) if sys.argv[1:] == ["all"] else sys.argv[1:]
run_checks([scenario_check(scenario) for scenario in chosen], rank=RANK,
           agree=kd.allgather_object)
