"""The shm transport at 1-4 ranks under mpiexec, one machine and pretend several.

Each case runs shm_engine_worker.py under ``mpiexec`` with a hard timeout; every
rank checks its results against numpy references and prints "OK <mode>".
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from keras_dist.launcher.cleanup import cleanup_shm, shm_snapshot

WORKER = os.path.join(os.path.dirname(__file__), "shm_engine_worker.py")
MPIEXEC = shutil.which("mpiexec") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_ranks(nranks, mode, *extra, mpiexec_flags=(), timeout=180):
    job = f"pt{uuid.uuid4().hex[:10]}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    command = [MPIEXEC, *mpiexec_flags, "-n", str(nranks), sys.executable, WORKER, mode,
               "--job", job, *extra]
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
        leftovers = glob.glob(f"/dev/shm/kd-{os.getuid()}-{job}-*")
        cleanup_shm(job, before)
    output = f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return done, output, leftovers


@pytest.mark.parametrize(
    "nranks, extra",
    [
        (1, ()),
        (2, ()),
        (3, ()),
        (4, ()),
        (2, ("--slot-bytes", "65536")),  # many chunks per message
        (4, ("--ranks-per-node", "2")),  # two pretend machines
        (3, ("--ranks-per-node", "2")),  # uneven machines
        # Single-copy reads from 4 KiB up, and never.
        (2, ("--single-copy-bytes", "4096", "--expect-single-copy", "1")),
        (3, ("--single-copy-bytes", "4096", "--expect-single-copy", "1")),
        (4, ("--single-copy-bytes", "4096", "--expect-single-copy", "1")),
        (3, ("--single-copy-bytes", "4096", "--ranks-per-node", "2")),
        (2, ("--single-copy", "off", "--expect-single-copy", "0")),
    ],
)
def test_collectives_match_numpy(nranks, extra):
    done, output, leftovers = run_ranks(nranks, "correctness", *extra)
    assert done.returncode == 0, output
    assert done.stdout.count("OK correctness") == nranks, output
    assert not leftovers, f"segments left in /dev/shm: {leftovers}\n{output}"


@pytest.mark.parametrize(
    "nranks, extra",
    [
        (2, ()),  # 10,000 back-to-back small allreduces
        (4, ("--repeat", "3000")),
        (3, ("--ranks-per-node", "2", "--repeat", "2000")),
        (3, ("--single-copy-bytes", "4096", "--repeat", "1000")),
    ],
)
def test_interleaved_and_many_small_collectives(nranks, extra):
    done, output, leftovers = run_ranks(nranks, "interleaved", *extra)
    assert done.returncode == 0, output
    assert done.stdout.count("OK interleaved") == nranks, output
    assert not leftovers, f"segments left in /dev/shm: {leftovers}\n{output}"


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
def test_allreduce_parts_matches_numpy_and_the_fused_path(nranks):
    done, output, leftovers = run_ranks(nranks, "parts", "--slot-bytes", str(4 << 20))
    assert done.returncode == 0, output
    assert done.stdout.count("OK parts") == nranks, output
    assert not leftovers, f"segments left in /dev/shm: {leftovers}\n{output}"


@pytest.mark.parametrize("nranks", [2, 3])
def test_mismatch_raises_on_every_rank(nranks):
    done, output, _ = run_ranks(nranks, "mismatch")
    assert done.returncode == 0, output
    assert done.stdout.count("OK mismatch") == nranks, output


@pytest.mark.parametrize("nranks, mode", [(3, "fallback_disabled"), (2, "fallback_unreadable")])
def test_single_copy_falls_back_to_copies_on_every_rank(nranks, mode):
    done, output, leftovers = run_ranks(nranks, mode)
    assert done.returncode == 0, output
    assert done.stdout.count(f"OK {mode}") == nranks, output
    assert not leftovers, f"segments left in /dev/shm: {leftovers}\n{output}"


@pytest.mark.parametrize("nranks, per_machine", [(2, 1), (4, 2), (3, 2)])
def test_mismatch_between_machines_raises_on_every_rank(nranks, per_machine):
    done, output, _ = run_ranks(
        nranks, "mismatch_machines", "--ranks-per-node", str(per_machine)
    )
    assert done.returncode == 0, output
    assert done.stdout.count("OK mismatch_machines") == nranks, output


@pytest.mark.parametrize("mode", ["stall", "timeout", "interrupt"])
def test_stall_timeout_and_interrupt(mode):
    done, output, _ = run_ranks(2, mode)
    assert done.returncode == 0, output
    assert done.stdout.count(f"OK {mode}") == 2, output


@pytest.mark.parametrize("count", [3, 1_000_000])  # the one-round and the single-copy path
def test_dead_peer_raises_on_survivors(count):
    done, output, leftovers = run_ranks(3, "death", "--death-count", str(count),
                                        mpiexec_flags=("-disable-auto-cleanup",))
    # The dead rank's exit status is the job's; the survivors must report.
    assert done.stdout.count("OK death") == 2, output
    assert not leftovers, f"segments left in /dev/shm: {leftovers}\n{output}"
