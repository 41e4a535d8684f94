"""The TensorFlow workers that share one kdrun job per number of ranks.

Starting TensorFlow costs seconds per process, and most TensorFlow workers of
this folder run at 1, 2 and 3 ranks. So one job per size runs them all, one
after another (``workers/suites.py``), each with its own settings, and each
test reads its own worker's output from that job (``suite_output``): a test
still fails by name, with every rank's output, and only for its own worker.
The job runs once per pytest session, when the first test needs it
(``tests/multiprocess/conftest.py``'s ``tf_job`` fixture).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from tests._mp import JobResult, run_job

RUNNER = Path(__file__).with_name("workers") / "suites.py"
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1",
       "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}
#: The hard timeout of a shared job (about the sum of its workers' former
#: jobs' timeouts at 3 ranks), and the pytest timeout of every test that uses
#: one (the first such test of a size runs the job).
JOB_TIMEOUT = 1500
TEST_TIMEOUT = JOB_TIMEOUT + 60

BOUNDED = {"KERAS_DIST_TIMEOUT_SECONDS": "60"}
SHM = {"KERAS_DIST_CPU_OPERATIONS": "shm"}
MPI = {"KERAS_DIST_CPU_OPERATIONS": "mpi"}
# Two pretend machines of 2 + 1 ranks: the hierarchical transport, a job
# that is not homogeneous.
TWO_MACHINES = {"KERAS_DIST_CPU_OPERATIONS": "shm", "KERAS_DIST_RANKS_PER_NODE": "2"}

HOROVOD_SUITES = {"tape.py": "TAPE", "sync_batch_norm.py": "SYNCBN",
                  "keras_api.py": "KERASAPI", "optimizer_options.py": "OPTOPTS",
                  "exchange.py": "EXCHANGE"}
ADASUM_NUMPY_ONLY = ["test_numpy_allreduce", "test_zero_tensor_on_one_rank",
                     "test_grouped_allreduce", "test_shape_mismatch"]

def _spec(label: str, worker: str, env: dict[str, str] | None = None) -> dict:
    return {"label": label, "path": f"workers/{worker}", "env": env or {}}


def _suites(np_: int) -> list[dict]:
    """Every worker the job of ``np_`` ranks runs, in order."""
    specs = [_spec(f"horovod-{name}", name, BOUNDED) for name in sorted(HOROVOD_SUITES)]
    # At 3 ranks, test_tf_api runs on two pretend machines.
    specs.append(_spec("tf_api", "tf_api.py", {**BOUNDED, **(TWO_MACHINES if np_ == 3 else {})}))
    # Adasum: every check at 2 ranks, the numpy ones at 1, the refusal at 3.
    adasum = {"ADASUM_TESTS": ",".join(ADASUM_NUMPY_ONLY)} if np_ == 1 else {}
    specs.append(_spec("adasum", "adasum.py", {**BOUNDED, **adasum}))
    # Odd sizes on the shm engine and the hierarchical transport, whose
    # splitting is ours; the MPI transport passes sizes to MPICH as they are.
    collectives = {1: {"mpi": MPI}, 2: {"mpi": MPI, "shm": SHM},
                   3: {"shm": SHM, "hierarchical": TWO_MACHINES}}[np_]
    specs += [_spec(f"collectives-{name}", "collectives.py", env)
              for name, env in collectives.items()]
    # join: at 3 ranks the TF path only on shm (the same code on the others).
    join = {1: {"shm": SHM}, 2: {"shm": SHM, "mpi": MPI},
            3: {"shm": SHM, "mpi": {**MPI, "JOIN_SKIP_TF": "1"},
                "hierarchical": {**TWO_MACHINES, "JOIN_SKIP_TF": "1"}}}[np_]
    specs += [_spec(f"join-{name}", "join.py", {**BOUNDED, **env}) for name, env in join.items()]
    # Property-based checks of the public API (hypothesis).
    specs.append(_spec("properties", "properties.py", BOUNDED))
    if np_ == 2:
        # 1 MiB slots: the traced op's 1.2 MB tensor goes through the engine in windows.
        specs.append(_spec("tf_kernel", "tf_kernel.py",
                           {**BOUNDED, **SHM, "KERAS_DIST_SHM_SLOT_BYTES": str(1 << 20)}))
    return specs


#: The test file (its name without ``.py``) that reads each worker's output, by label prefix.
OWNERS = {"horovod-": "test_horovod_api", "tf_api": "test_tf_api", "adasum": "test_adasum",
          "collectives-": "test_collectives", "join-": "test_join",
          "properties": "test_properties", "tf_kernel": "test_tf_kernel"}


def owner(label: str) -> str:
    """The test file that reads worker ``label``'s output."""
    (test,) = [test for prefix, test in OWNERS.items() if label.startswith(prefix)]
    return test


def run_tf_job(np_: int, tests: set[str] | None = None) -> JobResult:
    """Runs the TensorFlow workers of ``np_`` ranks in one kdrun job: every one,
    or those that the test files named in ``tests`` read."""
    specs = [json.dumps(spec) for spec in _suites(np_)
             if tests is None or owner(spec["label"]) in tests]
    return run_job([sys.executable, str(RUNNER), *specs], np=np_, timeout=JOB_TIMEOUT, env=ENV)


def suite_output(result: JobResult, label: str, rank: int) -> str:
    """What worker ``label`` printed on ``rank`` (stdout), once it ended without an error.

    Raises ``AssertionError`` with every rank's output when the worker failed,
    did not end, or when the job ended badly outside every worker.
    """
    stdout = result.rank_stdout.get(rank, "")
    section = re.search(rf"^SUITE {re.escape(label)} begins rank=\S+\n(.*?)"
                        rf"^SUITE {re.escape(label)} ends rank=\S+: (\w+)$",
                        stdout, flags=re.M | re.S)
    assert section is not None and section[2] == "ok", (
        f"worker {label!r} did not end well on rank {rank}"
        f"{'' if section is None else ' (' + section[2] + ')'}\n{result.describe()}")
    # A job that failed, or timed out, though every worker that began ended well:
    # it failed at exit. (A worker that did not end well fails its own test.)
    began = sum(len(re.findall(r"^SUITE \S+ begins ", text, flags=re.M))
                for text in result.rank_stdout.values())
    ended = sum(len(re.findall(r"^SUITE \S+ ends rank=\S+: ok$", text, flags=re.M))
                for text in result.rank_stdout.values())
    assert began > ended or (result.returncode == 0 and not result.timed_out), (
        f"the job ended badly after its workers\n{result.describe()}")
    return section[1]
