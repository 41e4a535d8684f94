"""kdrun's pieces that need no MPI job: argument parsing, the mpiexec command
line, the per-rank supervisor and its frames, labelled output, /dev/shm clean-up.
(Failure descriptions: tests/unit/test_report.py.)"""

import io
import mmap
import os
import secrets
import socket
import subprocess
import sys

import pytest

from keras_dist._runtime import jobstatus
from keras_dist.launcher import cleanup, cli, mpiexec, output, supervisor
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
        (["-np", "2", "--bind-to", "socket", "python"],
         "`--bind-to` must be one of none, core. Received: --bind-to 'socket'"),
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

ENV = {"KERAS_DIST_JOB_ID": "abc", "KERAS_DIST_TIMELINE": "/tmp/t l.json"}


def test_mpich_command():
    options = kdrun_options.parse_args(
        ["-np", "4", "-H", "a:2,b:2", "python", "x y.py", "--lr=0.1"])
    args = mpiexec.build_command("/bin/mpiexec", "mpich", options, ENV)
    assert args == [
        "/bin/mpiexec", "-hosts", "a:2,b:2",
        "-genv", "KERAS_DIST_JOB_ID", "abc", "-genv", "KERAS_DIST_TIMELINE", "/tmp/t l.json",
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
    assert "KERAS_DIST_JOB_ID=abc" in args and "KERAS_DIST_TIMELINE=/tmp/t l.json" in args
    assert args[-4:] == ["-np", "2", "python", "x.py"]


def test_bind_to_core_reaches_mpiexec_and_none_is_the_default():
    plain = kdrun_options.parse_args(["-np", "2", "python"], {})
    bound = kdrun_options.parse_args(["-np", "2", "--bind-to", "core", "python"], {})
    assert plain.bind_to == "none" and bound.bind_to == "core"
    assert "-bind-to" not in mpiexec.build_command("mpiexec", "mpich", plain, {})
    args = mpiexec.build_command("mpiexec", "mpich", bound, {})
    assert args[args.index("-bind-to") + 1] == "core"
    for options, what in ((plain, "none"), (bound, "core")):
        for flavor in ("openmpi", "openmpi5"):  # Open MPI would bind 1 or 2 ranks itself
            args = mpiexec.build_command("mpirun", flavor, options, {})
            assert args[args.index("--bind-to") + 1] == what, (flavor, args)


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


# --- output options ------------------------------------------------------------------


def test_parse_label_and_ranks_options():
    options = kdrun_options.parse_args(["-np", "3", "python"])
    assert options.label and options.ranks is None
    options = kdrun_options.parse_args(["-np", "3", "--no-label", "--ranks", "0,2", "python"])
    assert not options.label and options.ranks == (0, 2)
    assert kdrun_options.parse_args(["-np", "3", "--ranks=1", "x"]).ranks == (1,)
    assert "--ranks" in kdrun_options.USAGE and "--no-label" in kdrun_options.USAGE


@pytest.mark.parametrize("value", ["3", "0,x", "", "0,,1", "-1"])
def test_parse_ranks_errors(value):
    with pytest.raises(kdrun_options.UsageError,
                       match=rf"`--ranks` must be .* in \[0, 3\)\. Received: --ranks '{value}'"):
        kdrun_options.parse_args(["-np", "3", f"--ranks={value}", "python"])


# --- the supervisor ------------------------------------------------------------------


def test_supervisor_file_imports_only_the_standard_library():
    code = ("import importlib.util, sys; "
            f"spec = importlib.util.spec_from_file_location('s', {supervisor.__file__!r}); "
            "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
            "print(sorted(n for n in sys.modules if n.split('.')[0] in "
            "('keras_dist', 'mpi4py', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_supervised_command_runs_the_supervisor_by_path():
    assert cli.supervised_command(("python", "a b.py")) == (
        sys.executable, supervisor.__file__, "--", "python", "a b.py")
    assert supervisor.SUPERVISOR_FD_ENV == jobstatus.SUPERVISOR_FD_ENV


@pytest.mark.parametrize(
    "environ, expected",
    [({"PMI_RANK": "3", "PMI_SIZE": "4"}, (3, 4)), ({"PMIX_RANK": "1"}, (1, None)),
     ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "5"}, (2, 5)),
     ({"SLURM_PROCID": "7", "SLURM_NTASKS": "8"}, (7, 8))],
)
def test_supervisor_rank_from_the_process_manager(environ, expected):
    assert supervisor.rank_and_size(environ) == expected


def test_supervisor_without_a_rank_is_an_error():
    with pytest.raises(ValueError, match="PMI_RANK, PMIX_RANK.*Received none of them"):
        supervisor.rank_and_size({"PMI_RANK": "x"})


def test_line_splitter_cuts_lines_carriage_returns_and_long_lines():
    splitter = supervisor.LineSplitter(12, "o")
    assert splitter.feed(b"ab") == []
    assert splitter.feed(b"c\nd\re\n") == [supervisor.frame(12, "on", b"abc"),
                                          supervisor.frame(12, "or", b"d"),
                                          supervisor.frame(12, "on", b"e")]
    long_line = bytes(range(32, 127)) * 100  # 9500 bytes
    frames = splitter.feed(long_line + b"\ntail")
    assert all(len(data) <= supervisor.FRAME_BYTES for data in frames)
    assert [data.split(b" ")[2] for data in frames] == [b"o+", b"o+", b"on"]
    assert b"".join(data[len(supervisor.frame(12, "o+", b"")) - 1:-1] for data in frames) == (
        long_line)
    assert splitter.close() == [supervisor.frame(12, "o.", b"tail")]
    assert splitter.close() == []


def test_record_frame_shortens_a_long_message_to_fit():
    record = {"event": "error", "error": {"type": "E", "message": "é" * 5000}}
    data = supervisor.record_frame(0, record)
    assert len(data) <= supervisor.FRAME_BYTES and data.endswith(b"\n")
    assert b"[...]" in data


CHILD = r"""
import os, signal, sys
from keras_dist._runtime import jobstatus
from keras_dist.errors import PeerFailureError
mode = sys.argv[1]
os.fstat(int(os.environ["PMI_FD"]))  # the process manager's descriptor reached the command
print("out line", flush=True)
jobstatus.record_start(0)
if mode == "error":
    sys.stderr.write("traceback text\n"); sys.stderr.flush()
    print("ACK", jobstatus.record_error(PeerFailureError("rank 2 died", peer_rank=2)), flush=True)
    os._exit(1)
if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "finish":
    jobstatus.record_done(0)
if mode == "wait":
    print("READY", flush=True)
    signal.pause()
"""


def _run_supervisor(mode, signal_when_ready=None):
    """Runs the supervisor on CHILD under a fake process manager; returns (status, frames)."""
    read_end, write_end = os.pipe()
    env = dict(os.environ, PMI_RANK="5", PMI_SIZE="8", PMI_FD=str(write_end),
               PYTHONPATH=os.pathsep.join([str(cli.__file__).rsplit("/keras_dist/", 1)[0],
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, supervisor.__file__, "--", sys.executable, "-c", CHILD, mode],
        stdout=subprocess.PIPE, env=env, pass_fds=(write_end,))
    os.close(write_end)
    os.close(read_end)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if signal_when_ready and b"READY" in line:
            proc.send_signal(signal_when_ready)
    status = proc.wait(timeout=60)
    assert all(line.startswith(supervisor.MAGIC) for line in lines), lines
    return status, [line[len(supervisor.MAGIC):].rstrip(b"\n").split(b" ", 2) for line in lines]


def _records(frames):
    import json
    return [json.loads(payload) for rank, kind, payload in frames if kind == b"R"]


def test_supervisor_reports_a_clean_run():
    status, frames = _run_supervisor("finish")
    assert status == 0
    assert [b"5", b"on", b"out line"] in frames
    started, end = _records(frames)
    assert started["event"] == "started" and started["rank"] == 5
    assert end["event"] == "exit" and end["started"] and end["finished"]
    assert end["returncode"] == 0 and end["signal"] is None and end["error"] is None
    assert end["pid"] == started["pid"] and end["host"] and end["mono"] > started["mono"]


def test_supervisor_forwards_an_error_at_once_and_acknowledges_it():
    status, frames = _run_supervisor("error")
    assert status == 1
    kinds = [(kind, payload) for _, kind, payload in frames]
    error_at = next(i for i, (kind, p) in enumerate(kinds) if kind == b"R" and b'"error"' in p
                    and b'"event":"error"' in p)
    # The traceback the child wrote first goes out before the record.
    assert kinds.index((b"en", b"traceback text")) < error_at
    assert (b"on", b"ACK True") in kinds
    error = _records(frames)[1]["error"]
    assert error["type"] == "keras_dist.errors.PeerFailureError"
    assert error["message"] == "rank 2 died" and error["peer_rank"] == 2
    end = _records(frames)[-1]
    assert end["event"] == "exit" and end["returncode"] == 1 and end["error"] == error


def test_supervisor_reports_a_signal_and_fails():
    status, frames = _run_supervisor("kill")
    assert status == 128 + 9
    end = _records(frames)[-1]
    assert end["signal"] == "SIGKILL" and end["returncode"] is None and end["started"]
    assert end["stopped_by"] is None


def test_supervisor_fails_a_child_that_exits_0_without_finishing():
    status, frames = _run_supervisor("unfinished")
    assert status == 1
    end = _records(frames)[-1]
    assert end["returncode"] == 0 and end["started"] and not end["finished"]


def test_supervisor_forwards_sigterm_to_the_child():
    status, frames = _run_supervisor("wait", signal_when_ready=15)
    end = _records(frames)[-1]
    assert status == 128 + 15
    assert end["signal"] == "SIGTERM" and end["stopped_by"] == "SIGTERM"


def test_supervisor_reports_a_command_that_cannot_start(tmp_path):
    env = dict(os.environ, PMI_RANK="0")
    done = subprocess.run([sys.executable, supervisor.__file__, "--", str(tmp_path / "nope")],
                          capture_output=True, env=env, timeout=60)
    assert done.returncode == 127
    (record,) = _records([line[len(supervisor.MAGIC):].split(b" ", 2)
                          for line in done.stdout.splitlines()])
    assert "cannot run" in record["spawn_error"] and "No such file" in record["spawn_error"]


def test_jobstatus_leaves_alone_a_descriptor_that_is_not_its_parents_channel(monkeypatch):
    # A command started by a rank inherits the variable, not the descriptor.
    own_end, other_end = socket.socketpair()  # its peer is this process, not the parent
    read_end, write_end = os.pipe()
    try:
        for fd in (own_end.fileno(), read_end):
            monkeypatch.setenv(jobstatus.SUPERVISOR_FD_ENV, str(fd))
            assert not jobstatus.supervised()
            jobstatus.record_start(0)
            os.fstat(fd)  # still open
        other_end.sendall(b"x")
        assert own_end.recv(1) == b"x"  # nothing was written to it
    finally:
        for handle in (own_end, other_end):
            handle.close()
        os.close(read_end)
        os.close(write_end)


def test_jobstatus_writers_are_noops_without_a_supervisor(monkeypatch):
    monkeypatch.delenv(jobstatus.SUPERVISOR_FD_ENV, raising=False)
    assert not jobstatus.supervised()
    jobstatus.record_start(0)
    jobstatus.record_done(0)
    assert jobstatus.record_error(ValueError("x")) is False


# --- labelled output -----------------------------------------------------------------


class _Sink(io.BytesIO):
    pass


def _router(**options):
    records = []
    out, err = _Sink(), _Sink()
    return output.OutputRouter(out, err, records.append, **options), out, err, records


def _frames(rank, stream, text):
    splitter = supervisor.LineSplitter(rank, stream)
    return b"".join(splitter.feed(text) + splitter.close())


def test_router_prints_whole_labelled_lines_from_interleaved_frames():
    router, out, err, _ = _router()
    one = _frames(1, "o", b"A" * 9000 + b"\n")
    two = _frames(2, "o", b"B" * 9000 + b"\n")
    pieces_one, pieces_two = one.splitlines(True), two.splitlines(True)
    for a, b in zip(pieces_one, pieces_two):  # pieces of two ranks' lines alternate
        router.feed("o", a + b)
    router.feed("o", b"hydra says hi\n")
    router.close()
    assert out.getvalue().splitlines() == [
        b"[1] " + b"A" * 9000, b"[2] " + b"B" * 9000, b"hydra says hi"]
    assert err.getvalue() == b""


def test_router_stream_split_anywhere_gives_the_same_result():
    data = (_frames(0, "o", b"x\ny\n") + b"plain\n" + _frames(1, "e", b"z\n")
            + supervisor.record_frame(1, {"event": "started"}))
    for cut in range(len(data)):
        router, out, err, records = _router()
        router.feed("o", data[:cut])
        router.feed("o", data[cut:])
        router.close()
        assert out.getvalue() == b"[0] x\n[0] y\nplain\n", cut
        assert err.getvalue() == b"[1] z\n", cut
        assert records == [{"event": "started"}], cut


def test_router_carriage_return_progress_keeps_its_label():
    router, out, _, _ = _router()
    router.feed("o", _frames(3, "o", b"\r 1/3\r 2/3\r 3/3\r\ndone\n"))
    router.close()
    assert out.getvalue() == b"[3] \r[3]  1/3\r[3]  2/3\r[3]  3/3\r\n[3] done\n"


def test_router_without_labels_and_for_chosen_ranks():
    router, out, _, _ = _router(label=False, ranks=[0, 2])
    for rank in range(3):
        router.feed("o", _frames(rank, "o", b"r%d\rbar\n" % rank))
    router.close()
    assert out.getvalue() == b"r0\rbar\nr2\rbar\n"


def test_router_writes_unlabelled_files_per_rank(tmp_path):
    router, out, err, _ = _router(output_dir=str(tmp_path))
    router.feed("o", _frames(0, "o", b"a\r b\n") + _frames(1, "e", b"e1\nend"))
    router.close()
    assert out.getvalue() == b"" and err.getvalue() == b""
    assert (tmp_path / "rank0.stdout").read_bytes() == b"a\r b\n"
    assert (tmp_path / "rank1.stderr").read_bytes() == b"e1\nend"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.stdout", "rank1.stderr"]
