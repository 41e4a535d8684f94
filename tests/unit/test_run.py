"""kdrun's pieces that need no MPI job: argument parsing, the mpiexec command
line, status files, failure messages, /dev/shm clean-up."""

import mmap
import os
import secrets
import subprocess
import sys

import pytest

from keras_dist._runtime import jobstatus as _jobstatus
from keras_dist.launcher import cleanup, cli, mpiexec
from keras_dist.launcher import options as kdrun_options

# --- arguments -----------------------------------------------------------------


def test_parse_minimal():
    options = kdrun_options.parse_args(["-np", "2", "python", "train.py"])
    assert options.num_proc == 2
    assert options.command == ("python", "train.py")
    assert options.hosts == ()
    assert options.timeline is None


def test_parse_stops_at_the_command_and_keeps_its_arguments_untouched():
    argv = ["-np", "3", "--", "python", "-np", "7", "a b", "'q'", '"d"', "", "$HOME", "-H"]
    options = kdrun_options.parse_args(argv)
    assert options.num_proc == 3
    assert options.command == tuple(argv[3:])


def test_parse_first_non_option_starts_the_command():
    options = kdrun_options.parse_args(["-n", "2", "python", "--timeline", "x"])
    assert options.command == ("python", "--timeline", "x")
    assert options.timeline is None


def test_parse_hosts_timeline_and_equals_form(tmp_path):
    options = kdrun_options.parse_args(
        ["-np=4", "-H", "a:2,b:2", f"--timeline={tmp_path}/t.json", "python", "x.py"]
    )
    assert options.num_proc == 4
    assert options.hosts == (("a", 2), ("b", 2))
    assert options.timeline == f"{tmp_path}/t.json"


def test_parse_relative_timeline_is_made_absolute():
    options = kdrun_options.parse_args(["-np", "1", "--timeline", "t.json", "python"])
    assert options.timeline == os.path.abspath("t.json")


def test_parse_host_without_slots_counts_one():
    assert kdrun_options.parse_args(["-np", "2", "-H", "a,b", "x"]).hosts == (("a", 1), ("b", 1))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["python", "x.py"], "-np N` is required"),
        (["-np", "0", "python"], "Received: -np '0'"),
        (["-np", "two", "python"], "Received: -np 'two'"),
        (["-np", "2"], "No command"),
        (["-np"], "needs a value"),
        (["-np", "2", "--bogus", "python"], "Unknown option '--bogus'"),
        (["-np", "2", "-H", "a:0", "python"], "slots >= 1"),
        (["-np", "2", "-H", "a:x", "python"], "slots >= 1"),
        (["-np", "2", "-H", ",", "python"], "slots >= 1"),
    ],
)
def test_parse_errors(argv, message):
    pattern = message.replace("(", r"\(").replace("$", r"\$")
    with pytest.raises(kdrun_options.UsageError, match=pattern):
        kdrun_options.parse_args(argv)


def test_main_usage_errors_exit_2(capsys):
    assert cli.main(["-np", "2"]) == 2
    err = capsys.readouterr().err
    assert "kdrun: No command" in err and "usage: kdrun" in err


def test_main_help_exits_0(capsys):
    assert cli.main(["--help"]) == 0
    assert "usage: kdrun" in capsys.readouterr().out


# --- the mpiexec command line ----------------------------------------------------

ENV = {"KERAS_DIST_JOB_ID": "abc", "KERAS_DIST_STATUS_DIR": "/tmp/s d"}


def test_mpich_command():
    options = kdrun_options.parse_args(
        ["-np", "4", "-H", "a:2,b:2", "python", "x y.py", "--lr=0.1"])
    args = mpiexec.build_command("/bin/mpiexec", "mpich", options, ENV)
    assert args == [
        "/bin/mpiexec", "-hosts", "a:2,b:2",
        "-genv", "KERAS_DIST_JOB_ID", "abc", "-genv", "KERAS_DIST_STATUS_DIR", "/tmp/s d",
        "-n", "4", "python", "x y.py", "--lr=0.1",
    ]


def test_mpich_output_dir():
    options = kdrun_options.parse_args(["-np", "2", "--output-dir", "/o", "python"], {})
    args = mpiexec.build_command("mpiexec", "mpich", options, {})
    assert args[1:5] == ["-outfile-pattern", "/o/rank%r.stdout", "-errfile-pattern",
                         "/o/rank%r.stderr"]


def test_openmpi_command():
    options = kdrun_options.parse_args(["-np", "2", "-H", "a:1,b:1", "python", "x.py"])
    args = mpiexec.build_command("mpirun", "openmpi", options, ENV)
    assert "--oversubscribe" in args
    assert ("--allow-run-as-root" in args) == (os.geteuid() == 0)
    assert args[args.index("-H") + 1] == "a:1,b:1"
    assert "KERAS_DIST_JOB_ID=abc" in args and "KERAS_DIST_STATUS_DIR=/tmp/s d" in args
    assert args[-4:] == ["-np", "2", "python", "x.py"]


def test_openmpi_output_dir():
    options = kdrun_options.parse_args(["-np", "2", "--output-dir", "/o", "python"], {})
    assert "--output-filename" in mpiexec.build_command("mpirun", "openmpi", options, {})
    args = mpiexec.build_command("mpirun", "openmpi5", options, {})
    assert args[args.index("--output") + 1] == "dir=/o"


def _fake_mpiexec(tmp_path, version_text):
    path = tmp_path / "mpiexec"
    path.write_text(f"#!/bin/sh\necho '{version_text}'\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize(
    "text, flavor",
    [
        ("mpiexec (OpenRTE) 4.1.2", "openmpi"),
        ("mpirun (Open MPI) 4.1.6", "openmpi"),
        ("mpiexec (Open MPI) 5.0.11", "openmpi5"),
        ("HYDRA build details:\n    Version: 5.0.2", "mpich"),
        ("Intel(R) MPI Library for Linux* OS, Version 2021.10", "mpich"),
    ],
)
def test_mpi_flavor(tmp_path, text, flavor):
    assert mpiexec.mpi_flavor(_fake_mpiexec(tmp_path, text)) == flavor


def test_find_mpiexec_prefers_the_one_beside_python(tmp_path, monkeypatch):
    beside = _fake_mpiexec(tmp_path, "x")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    assert mpiexec.find_mpiexec() == beside


def test_find_mpiexec_falls_back_to_path(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    on_path = _fake_mpiexec(bin_dir, "x")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(bin_dir))
    assert mpiexec.find_mpiexec() == on_path
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert mpiexec.find_mpiexec() is None


def test_missing_mpiexec_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert cli.main(["-np", "2", "python", "x.py"]) == 127
    assert "cannot find mpiexec" in capsys.readouterr().err


def test_launcher_never_imports_mpi4py():
    code = "import sys, keras_dist.run; print('mpi4py' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"


# --- status files ------------------------------------------------------------------


def test_status_writers_are_noops_without_a_directory(monkeypatch, tmp_path):
    monkeypatch.delenv(_jobstatus.STATUS_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    _jobstatus.record_start(0)
    _jobstatus.record_error(0, "x")
    _jobstatus.record_done(0)
    assert list(tmp_path.iterdir()) == []


def test_status_round_trip(monkeypatch, tmp_path):
    monkeypatch.setenv(_jobstatus.STATUS_DIR_ENV, str(tmp_path))
    _jobstatus.record_start(0)
    _jobstatus.record_start(1)
    _jobstatus.record_done(0)
    text = 'Traceback (most recent call last):\n  File "x"\nValueError: bad value\n'
    _jobstatus.record_error(1, text)
    statuses = _jobstatus.read_status(str(tmp_path))
    assert sorted(statuses) == [0, 1]
    zero, one = statuses[0], statuses[1]
    assert zero.started and zero.done and zero.error is None
    assert zero.pid == os.getpid() and zero.host
    assert one.started and not one.done and one.error == text
    assert one.error_summary == "ValueError: bad value"
    assert one.describe() == f"rank 1 (pid {os.getpid()} on {one.host})"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_start_again_clears_done(monkeypatch, tmp_path):
    monkeypatch.setenv(_jobstatus.STATUS_DIR_ENV, str(tmp_path))
    _jobstatus.record_start(2)
    _jobstatus.record_done(2)
    _jobstatus.record_start(2)
    assert not _jobstatus.read_status(str(tmp_path))[2].done


def test_status_writers_never_raise(monkeypatch, tmp_path):
    monkeypatch.setenv(_jobstatus.STATUS_DIR_ENV, str(tmp_path / "missing"))
    _jobstatus.record_start(0)
    _jobstatus.record_error(0, "x")
    _jobstatus.record_done(0)


def test_read_status_ignores_garbage(tmp_path):
    (tmp_path / "rank0.start").write_text("{not json")
    (tmp_path / "rank1.error").write_text("[keras_dist rank 1/2] KeyError: 'k'\n")
    (tmp_path / "other.txt").write_text("x")
    statuses = _jobstatus.read_status(str(tmp_path))
    assert statuses[0].started and statuses[0].pid is None
    assert statuses[0].describe() == "rank 0"
    assert statuses[1].error_summary == "KeyError: 'k'"
    assert _jobstatus.read_status(str(tmp_path / "missing")) == {}


# --- failure messages ----------------------------------------------------------------


def _status(rank, **fields):
    fields.setdefault("started", True)
    return _jobstatus.RankStatus(rank=rank, pid=100 + rank, host="h", **fields)


def test_describe_exception():
    statuses = {0: _status(0), 1: _status(1, error="Traceback\nValueError: v\n")}
    lines = cli.describe_failure(statuses, 2, [], 1)
    assert lines == [
        "kdrun: rank 1 (pid 101 on h) raised an exception: ValueError: v",
        "kdrun: rank 0 stopped when the job ended.",
    ]


def test_describe_dead_rank_comes_before_the_errors_its_death_caused():
    statuses = {
        0: _status(0, error="PeerFailureError: rank 1 died during allreduce\n"),
        1: _status(1),
        2: _status(2),
    }
    lines = cli.describe_failure(statuses, 3, [1], 9)
    assert lines == [
        "kdrun: rank 1 (pid 101 on h) ended without finishing: "
        "killed by a signal or exited early",
        "kdrun: rank 0 (pid 100 on h) raised an exception: "
        "PeerFailureError: rank 1 died during allreduce",
        "kdrun: rank 2 stopped when the job ended.",
    ]


def test_describe_dead_rank_uses_exit_order():
    statuses = {r: _status(r) for r in range(3)}
    lines = cli.describe_failure(statuses, 3, [2, 0, 1], 9)
    assert lines == [
        "kdrun: rank 2 (pid 102 on h) ended without finishing: "
        "killed by a signal or exited early",
        "kdrun: ranks 0, 1 stopped when the job ended.",
    ]


def test_describe_exit_order_may_hold_ranks_without_status():
    statuses = {0: _status(0), 1: _status(1)}
    lines = cli.describe_failure(statuses, 3, [2, 1, 0], 9)
    assert lines[0].startswith("kdrun: rank 1 (pid 101 on h) ended without finishing")
    assert lines[-1].startswith("kdrun: rank 2 never reported starting")


def test_describe_rank_that_died_before_init():
    lines = cli.describe_failure({}, 3, [2, 0, 1], 9, {2: 4242, 0: 4240, 1: 4241})
    assert lines == ["kdrun: rank 2 (pid 4242) ended before keras_dist.init() finished: "
                     "killed by a signal or exited early"]
    lines = cli.describe_failure({0: _status(0)}, 3, [2, 0], 9, {2: 4242})
    assert lines == [
        "kdrun: rank 2 (pid 4242) ended before keras_dist.init() finished: "
        "killed by a signal or exited early",
        "kdrun: rank 0 stopped when the job ended.",
        "kdrun: rank 1 never reported starting (failed or stopped before keras_dist.init()).",
    ]


def test_describe_dead_rank_without_exit_order_names_every_suspect():
    statuses = {0: _status(0, done=True), 1: _status(1), 2: _status(2)}
    lines = cli.describe_failure(statuses, 3, [], 9)
    assert [line.split(" (")[0] for line in lines] == ["kdrun: rank 1", "kdrun: rank 2"]


def test_describe_ranks_that_never_started():
    lines = cli.describe_failure({0: _status(0, error="E: e")}, 3, [], 1)
    assert lines[-1].startswith("kdrun: ranks 1, 2 never reported starting")
    lines = cli.describe_failure({}, 2, [], 1)
    assert lines == [
        "kdrun: the job failed (mpiexec exit code 1) and no rank reported its status: "
        "the command may have failed before keras_dist.init()."
    ]


# --- /dev/shm clean-up ------------------------------------------------------------------


def _shm(name):
    path = os.path.join(cleanup.SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    return path, fd


def test_cleanup_shm_removes_only_what_the_job_left(tmp_path, monkeypatch):
    # A private stand-in for /dev/shm, so that other jobs' clean-ups cannot interfere.
    monkeypatch.setattr(cleanup, "SHM_DIR", str(tmp_path))
    job_id = secrets.token_hex(8)
    token = secrets.token_hex(4)
    old_path, old_fd = _shm(f"mpich_shm_kdtest{token}_old")
    before = cleanup.shm_snapshot()
    ours_path, ours_fd = _shm(f"kd-{os.geteuid()}-{job_id}-0")
    leaked_path, leaked_fd = _shm(f"mpich_shm_kdtest{token}_leaked")
    live_path, live_fd = _shm(f"mpich_shm_kdtest{token}_live")
    other_path, other_fd = _shm(f"kdtest{token}_unrelated")
    live_map = mmap.mmap(live_fd, 4096)
    for fd in (old_fd, ours_fd, leaked_fd, live_fd, other_fd):
        os.close(fd)
    try:
        removed = cleanup.cleanup_shm(job_id, before)
        assert os.path.basename(ours_path) in removed
        assert os.path.basename(leaked_path) in removed
        assert not os.path.exists(ours_path) and not os.path.exists(leaked_path)
        # Present before the job, still mapped, or not a job file: kept.
        assert os.path.exists(old_path) and os.path.exists(live_path)
        assert os.path.exists(other_path)
    finally:
        live_map.close()
        for path in (old_path, ours_path, leaked_path, live_path, other_path):
            if os.path.exists(path):
                os.unlink(path)


def test_find_job_processes_sees_a_child_by_its_environment():
    job_id = secrets.token_hex(8)
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env=dict(os.environ, KERAS_DIST_JOB_ID=job_id),
    )
    try:
        assert cleanup.find_job_processes(cleanup.JOB_ID_ENV, job_id) == [child.pid]
        assert cleanup.kill_job_processes(job_id) == 1
        assert child.wait(timeout=10) == -9
        assert cleanup.find_job_processes(cleanup.JOB_ID_ENV, job_id) == []
    finally:
        if child.poll() is None:
            child.kill()


def test_error_summary_finds_the_exception_line_in_a_tensorflow_traceback():
    text = (
        "Traceback (most recent call last):\n"
        '  File "train.py", line 3, in <module>\n'
        "tensorflow.python.framework.errors_impl.UnknownError: {{function_node x}} "
        "TypeError: bad buffer\n"
        "Traceback (most recent call last):\n\n"
        "TypeError: `buf` must have dtype uint8\n\n\n"
        "\t [[{{node keras_dist_allreduce}}]] [Op:__inference_multi_step_on_iterator_318]\n"
    )
    status = _jobstatus.RankStatus(rank=0, error=text)
    assert status.error_summary == "TypeError: `buf` must have dtype uint8"
    assert _jobstatus.RankStatus(rank=0, error="odd\n").error_summary == "odd"
    assert _jobstatus.RankStatus(rank=0, error="\n").error_summary == "(empty traceback)"


def test_exit_rank_puts_reaped_then_killed_then_exited_processes():
    exited = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.kill()
    for child in (exited, killed):
        while True:  # a zombie until waited for
            with open(f"/proc/{child.pid}/stat") as handle:
                if handle.read().rpartition(")")[2].split()[0] == "Z":
                    break
    try:
        assert cli._exit_rank(killed.pid) == 1
        assert cli._exit_rank(exited.pid) == 2
    finally:
        exited.wait()
        killed.wait()
    assert cli._exit_rank(killed.pid) == 0  # reaped: its parent saw it end first


def test_exit_order_continues_past_a_peer_failure_but_not_past_other_errors(
        tmp_path, monkeypatch):
    monkeypatch.setenv(_jobstatus.STATUS_DIR_ENV, str(tmp_path))
    for rank in range(3):
        _jobstatus.record_start(rank)
    watcher = cli._RankWatcher(str(tmp_path), "job", 3, all_local=True)
    # Rank 0 saw rank 1 die and reported it before rank 1's exit was seen.
    _jobstatus.record_error(0, "Traceback\nkeras_dist.errors.PeerFailureError: rank 1 died\n")
    watcher._record_exit(1, 101)
    assert watcher.exit_order == [1]
    # After any other error, exits are consequences: the order stops.
    _jobstatus.record_error(2, "Traceback\nValueError: v\n")
    watcher._record_exit(0, 100)
    assert watcher.exit_order == [1]
    lines = cli.describe_failure(watcher.statuses, 3, watcher.exit_order, 9)
    assert lines[0].startswith("kdrun: rank 1 (pid ") and "ended without finishing" in lines[0]


def test_describe_names_every_rank_whose_exits_could_not_be_ordered():
    statuses = {r: _status(r) for r in range(3)}
    lines = cli.describe_failure(statuses, 3, [0, 1, 2], 9, first_tied=[0, 1])
    assert lines == [
        "kdrun: rank 0 (pid 100 on h) or rank 1 (pid 101 on h) ended without finishing: "
        "killed by a signal or exited early (their exits reached kdrun at once, so which "
        "came first is unknown)",
        "kdrun: rank 2 stopped when the job ended.",
    ]
    # A tie behind a clear first exit changes nothing.
    lines = cli.describe_failure(statuses, 3, [2, 0, 1], 9, first_tied=[])
    assert lines[0].startswith("kdrun: rank 2 (pid 102 on h) ended without finishing")


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open (Linux 5.3+)")
def test_watcher_records_exits_it_cannot_order(tmp_path):
    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
                for _ in range(2)]
    watcher = cli._RankWatcher(str(tmp_path), "job", 2, all_local=True)
    for rank, child in enumerate(children):
        watcher._watch(rank, child.pid)
    for child in children:  # both end and are reaped before the watcher looks
        child.kill()
        child.wait()
    watcher._next_scan = float("inf")
    watcher.poll(1.0)
    watcher.close()
    assert sorted(watcher.exit_order) == [0, 1]
    assert sorted(watcher.first_tied) == [0, 1]
