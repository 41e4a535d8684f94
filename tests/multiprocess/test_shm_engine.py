"""The shm transport at 1-4 ranks under mpiexec, one machine and pretend several.

shm_engine_worker.py runs on every rank under plain ``mpiexec`` (not kdrun, whose
clean-up would hide a segment the transport left behind) with a hard timeout;
every rank checks its results against numpy references. One job per number of
ranks runs every case of that size, one after another (a process start costs
more than most cases), and each test reads its own case's lines from that job:
"CHECK <case> ok rank=R" on every rank, and no segment of the case left in
/dev/shm. A case that fails is named at the top of every test's message that
reads it, with all ranks' output. Only the cases whose tests this session runs
are run. The dead-peer cases end a rank on purpose, so each has a job of its own.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import uuid

import pytest

from keras_dist.launcher.cleanup import cleanup_shm, shm_snapshot

WORKER = os.path.join(os.path.dirname(__file__), "shm_engine_worker.py")
MPIEXEC = shutil.which("mpiexec") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: The hard timeout of one job, and the pytest timeout of a test that may run one.
JOB_TIMEOUT = 600
TEST_TIMEOUT = JOB_TIMEOUT + 60

CORRECTNESS = [
    (1, "correctness"),
    (2, "correctness"),
    (3, "correctness"),
    (4, "correctness"),
    (2, "correctness --slot-bytes 65536"),  # many chunks per message
    (4, "correctness --ranks-per-node 2"),  # two pretend machines
    (3, "correctness --ranks-per-node 2"),  # uneven machines
    # Single-copy reads from 4 KiB up, and never.
    (2, "correctness --single-copy-bytes 4096 --expect-single-copy 1"),
    (3, "correctness --single-copy-bytes 4096 --expect-single-copy 1"),
    (4, "correctness --single-copy-bytes 4096 --expect-single-copy 1"),
    (3, "correctness --single-copy-bytes 4096 --ranks-per-node 2"),
    (2, "correctness --single-copy off --expect-single-copy 0"),
]
INTERLEAVED = [
    (2, "interleaved"),  # 10,000 back-to-back small allreduces
    (4, "interleaved --repeat 3000"),
    (3, "interleaved --ranks-per-node 2 --repeat 2000"),
    (3, "interleaved --single-copy-bytes 4096 --repeat 1000"),
]
PARTS = [(n, f"parts --slot-bytes {4 << 20}") for n in (1, 2, 3, 4)]
MISMATCH = [(2, "mismatch"), (3, "mismatch")]
FALLBACK = [(3, "fallback_disabled"), (2, "fallback_unreadable")]
MISMATCH_MACHINES = [(2, "mismatch_machines --ranks-per-node 1"),
                     (4, "mismatch_machines --ranks-per-node 2"),
                     (3, "mismatch_machines --ranks-per-node 2")]
# Last in their job: each leaves a transport aborted (closed, then replaced).
STALL_TIMEOUT_INTERRUPT = [(2, "stall"), (2, "timeout"), (2, "interrupt")]
#: Every shared case, in the order its job runs them.
ORDER = [*CORRECTNESS, *INTERLEAVED, *PARTS, *MISMATCH, *FALLBACK, *MISMATCH_MACHINES,
         *STALL_TIMEOUT_INTERRUPT]


def run_ranks(nranks, cases, *, mpiexec_flags=(), timeout=JOB_TIMEOUT):
    """Runs `cases` one after another in one job of `nranks` ranks.

    Returns the finished process, its output, and ``{case: segments it left}``.
    """
    job = f"pt{uuid.uuid4().hex[:10]}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    command = [MPIEXEC, *mpiexec_flags, "-n", str(nranks), sys.executable, WORKER,
               "--job", job, *cases]
    before = shm_snapshot()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(command)} ran over {timeout} s\nstdout:\n{exc.stdout}\n"
                    f"stderr:\n{exc.stderr}")
    finally:
        # Plain mpiexec leaves MPICH's own segment behind when a rank dies or
        # aborts (the death and timeout cases do that on purpose): remove it as
        # kdrun would, so the suite leaves /dev/shm as it found it.
        leftovers = {case: glob.glob(f"/dev/shm/kd-{os.getuid()}-{job}_c{index}-*")
                     for index, case in enumerate(cases)}
        cleanup_shm(job, before)
    # mpiexec forwards the ranks' output as it comes: one rank's line may run into another's.
    failed = re.findall(r"CHECK [^\n]*? (?:FAILED|NOT RUN) rank=\d+[^\n]*", done.stdout)
    output = (f"exit code {done.returncode}: {' '.join(command)}\n"
              + (f"failed cases:\n{chr(10).join(failed)}\n" if failed else "")
              + f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}")
    return done, output, leftovers


@pytest.fixture(scope="module")
def shm_job(request):
    """``shm_job(nranks)``: the job that ran this session's cases of `nranks` ranks, run once."""
    wanted = {(item.callspec.params["nranks"], item.callspec.params["case"])
              for item in request.session.items
              if item.path == request.path and hasattr(item, "callspec")
              and "case" in item.callspec.params}
    jobs = {}

    def result(nranks):
        if nranks not in jobs:
            cases = [case for n, case in ORDER if n == nranks and (n, case) in wanted]
            jobs[nranks] = run_ranks(nranks, cases)
        return jobs[nranks]

    return result


def check_case(shm_job, nranks, case, *, leaves_nothing=True):
    done, output, leftovers = shm_job(nranks)
    for rank in range(nranks):
        passed = re.search(re.escape(f"CHECK {case} ok rank={rank}") + r"(?!\d)", done.stdout)
        assert passed, f"{case} on rank {rank}\n{output}"
    # A failure of the job's other cases explains a failed exit; nothing else does.
    assert done.returncode == 0 or " FAILED rank=" in output, output
    if leaves_nothing:
        assert not leftovers[case], f"segments left in /dev/shm: {leftovers[case]}\n{output}"


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("nranks, case", CORRECTNESS)
def test_collectives_match_numpy(shm_job, nranks, case):
    check_case(shm_job, nranks, case)


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("nranks, case", INTERLEAVED)
def test_interleaved_and_many_small_collectives(shm_job, nranks, case):
    check_case(shm_job, nranks, case)


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("nranks, case", PARTS)
def test_allreduce_parts_matches_numpy_and_the_fused_path(shm_job, nranks, case):
    check_case(shm_job, nranks, case)


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("nranks, case", MISMATCH)
def test_mismatch_raises_on_every_rank(shm_job, nranks, case):
    check_case(shm_job, nranks, case, leaves_nothing=False)


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("nranks, case", FALLBACK)
def test_single_copy_falls_back_to_copies_on_every_rank(shm_job, nranks, case):
    check_case(shm_job, nranks, case)


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("nranks, case", MISMATCH_MACHINES)
def test_mismatch_between_machines_raises_on_every_rank(shm_job, nranks, case):
    check_case(shm_job, nranks, case, leaves_nothing=False)


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("nranks, case", STALL_TIMEOUT_INTERRUPT)
def test_stall_timeout_and_interrupt(shm_job, nranks, case):
    check_case(shm_job, nranks, case, leaves_nothing=False)


@pytest.mark.parametrize("count", [3, 1_000_000])  # the one-round and the single-copy path
def test_dead_peer_raises_on_survivors(count):
    done, output, leftovers = run_ranks(3, [f"death --death-count {count}"], timeout=180,
                                        mpiexec_flags=("-disable-auto-cleanup",))
    # The dead rank's exit status is the job's; the survivors must report.
    assert done.stdout.count("OK death") == 2, output
    assert not [name for names in leftovers.values() for name in names], (
        f"segments left in /dev/shm: {leftovers}\n{output}")
