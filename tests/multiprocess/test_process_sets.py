"""Process sets at 2 and 3 ranks, under kdrun.

The worker checks every collective on a set, on every member, against numpy
float64 references built from the members' data only; here every check must
be reported passed by every rank. Modes: static sets (``init(process_sets=
[...])``), dynamic sets enabled by ``init`` or by the environment, and sets
made from a split MPI communicator.
"""

import re
import sys
from pathlib import Path

import pytest

from tests._mp import run_job

WORKER = Path(__file__).with_name("workers") / "process_sets.py"
DYNAMIC_BY_ENV = {"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}
MPI = {"KERAS_DIST_CPU_OPERATIONS": "mpi"}
# Two pretend machines of 2 + 1 ranks: the job's transport is hierarchical.
TWO_MACHINES = {"KERAS_DIST_CPU_OPERATIONS": "shm", "KERAS_DIST_RANKS_PER_NODE": "2"}
# (worker mode, ranks, environment, id)
CASES = [
    *[(mode, np_, {}, f"{mode}-np{np_}") for mode in ("static", "dynamic", "comm")
      for np_ in (2, 3)],
    ("env", 2, DYNAMIC_BY_ENV, "dynamic-by-env-np2"),
    ("static", 3, MPI, "static-mpi-np3"),
    ("dynamic", 3, MPI, "dynamic-mpi-np3"),
    ("static", 3, TWO_MACHINES, "static-two-machines-np3"),
]


def _checks(mode: str) -> list[str]:
    """The checks the worker runs in ``mode`` (its CHECKS table)."""
    text = WORKER.read_text()
    listed = re.search(rf'"{"dynamic" if mode == "env" else mode}": \[(.*?)\]', text,
                       flags=re.S)
    assert listed, mode
    return re.findall(r"test_\w+", listed[1])


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("mode", "np_", "env"), [c[:3] for c in CASES],
                         ids=[c[3] for c in CASES])
def test_process_sets_on_every_rank(mode, np_, env):
    env = {"OMP_NUM_THREADS": "1", "KERAS_DIST_TIMEOUT_SECONDS": "60", **env}
    result = run_job([sys.executable, str(WORKER), mode], np=np_, timeout=200, env=env)
    message = result.describe()
    for rank in range(np_):
        for check in [*_checks(mode), "shutdown"]:
            assert f"PSETS {check} passed rank={rank}" in result.output(rank), (
                f"{check} on rank {rank}\n{message}")
    result.check()
