"""A stranger attacks the rendezvous port of self-started jobs (torchrun's
variables) while they start and while they train, and gets nothing.

Each job trains with checked allreduces (``rendezvous_attack_worker.py``:
every result against a float64 reference, identical weights at the end) until
the test, its attacks over, tells rank 0 to stop. Meanwhile a stranger in
this process, from threads:

(a) opens and closes 300 connections (a port scanner, a Kubernetes TCP probe),
(b) sends HTTP requests (and a TLS greeting),
(c) sends 256 MiB with no newline, and 16 MiB of random bytes,
(d) holds 3,000 connections open,
(e) sends every command of the protocol with malformed, missing, huge and
    negative fields and missing, junk or wrongly keyed macs,
(f) watches (``cmd=kd_watch rank=0`` with a wrong mac, and a plain line), then
    says ``abort``;

and before every rank has come (rank 0 starts alone; the others start once
these are over), (g) greets with another world size and (h) claims a rank
that a real rank will claim. With the job's secret set, every stranger hears
the challenge and ``kd_denied`` and nothing else (never ``kd_ready``,
``kd_welcome`` or a store value) and the job trains to the end. Without a
secret, (a)-(f) still leave the job alone ((g) and (h) cannot be told from a
misconfigured rank then), and so does a stranger that proves the empty key,
as anyone can then: its watch and ``abort`` are not heard, its greeting as a
latecomer is refused alone. And a stranger that opens connections as fast as
it can while the ranks start (each new one drops the oldest unproven one)
ends no rank: a rank's greeting or watch that was dropped is tried again.
The process manager's peak RSS (VmHWM) stays under 64 MiB under all of it
(measured: 19.5 MiB at the end, 18.8 MiB before the attacks).
"""

import errno
import os
import re
import resource
import secrets
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from keras_dist._runtime import wire
from tests._mp import REPO_ROOT
from tests._selfstart import free_port, start_self_started, torchrun_variables
from tests.faults.stranger import ALLOWED, CONNECTIONS_HELD, Stranger

WORKER = str(REPO_ROOT / "tests" / "faults" / "rendezvous_attack_worker.py")
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1",
         "KERAS_DIST_TIMEOUT_SECONDS": "60", "KERAS_DIST_RENDEZVOUS_TIMEOUT": "60"}
SECRET = "attack-test-" + secrets.token_hex(16)
RSS_LIMIT_KIB = 64 << 10


# -- the job ----------------------------------------------------------------------------

def process_manager_of(pid):
    """The pid of the ``pmi_server.py`` that rank 0 (``pid``) started."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"pmi_server.py" in cmdline:
            return int(entry.name)
    return None


def peak_rss_kib(pid):
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1))


def until_listening(port, deadline):
    """Waits until rank 0's process manager serves on ``port``: until a
    connection gets its first line, the challenge. Rank 0 binds the port
    before it starts the manager, so a connection that is merely accepted (by
    the listen backlog) says nothing about the manager; a refused one says
    that nothing listens yet."""
    pause = 0.01
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.settimeout(max(1.0, deadline - time.monotonic()))
                if wire.parse_line(sock.makefile("rb").readline()).get("cmd") == "kd_challenge":
                    return
        except (ConnectionRefusedError, ConnectionResetError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no process manager served on port {port}")
        threading.Event().wait(pause)
        pause = min(pause * 2, 0.2)


def wake_when_a_rank_ends(procs, path):
    """Says ``ended`` on the control socket at ``path`` when one of ``procs``
    ends, so that a test waiting there for rank 0's ``up`` hears at once that
    a rank died before the job formed."""
    def wait(proc):
        proc.wait()
        try:
            with socket.socket(socket.AF_UNIX) as sock:
                sock.connect(path)
                sock.sendall(b"ended\n")
        except OSError:
            pass  # the test has stopped listening: the job was up
    for proc in procs:
        threading.Thread(target=wait, args=(proc,), daemon=True).start()


class Control:
    """The test's end of the workers' control socket: rank 0 says ``up`` there
    once the job has formed, and stops training once told (or once the test
    closes it)."""

    def __init__(self):
        self.scratch = tempfile.TemporaryDirectory(prefix="kdatk-")
        self.path = os.path.join(self.scratch.name, "control")
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(self.path)
        self.listener.listen(1)
        self.listener.settimeout(120)
        self.told = None
        self.command = [sys.executable, WORKER, self.path]

    def wait_until_up(self, procs):
        """Until rank 0 says the job is up; raises when a rank of ``procs`` ends first."""
        wake_when_a_rank_ends(procs, self.path)
        self.told, _ = self.listener.accept()
        self.told.settimeout(120)
        said = self.told.recv(6)
        assert said == b"up\n", f"rank 0 did not say the job is up: {said!r}"

    def stop(self):
        """Tells rank 0 to stop: every rank ends at the same step."""
        if self.told is not None:
            try:
                self.told.sendall(b"stop\n")
            except OSError:
                pass  # rank 0 has ended already
            self.told.close()
        self.listener.close()
        self.scratch.cleanup()


@pytest.fixture
def many_descriptors():
    """Room for CONNECTIONS_HELD connections in this process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = CONNECTIONS_HELD + 1024
    if soft < wanted:
        if hard != resource.RLIM_INFINITY and hard < wanted:
            pytest.skip(f"RLIMIT_NOFILE's hard limit {hard} leaves no room for "
                        f"{CONNECTIONS_HELD} connections")
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


CASES = {"a": "open_and_close", "b": "http", "c": "flood", "e": "commands",
         "f": "watch_then_abort"}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("size, with_secret", [(2, True), (3, True), (2, False)],
                         ids=["2_ranks_secret", "3_ranks_secret", "2_ranks_no_secret"])
def test_a_stranger_gets_nothing_and_the_job_trains_to_the_end(size, with_secret,
                                                              many_descriptors):
    port = free_port()
    env = {**QUIET, "KERAS_DIST_SECRET": SECRET if with_secret else None,
           "KERAS_DIST_SECRET_FILE": None}
    torchrun = torchrun_variables(size, port)
    control = Control()
    stranger = Stranger(port)
    first = start_self_started(control.command, np=1, env=env, variables=lambda _: torchrun(0))
    others = failure = None
    try:
        until_listening(port, time.monotonic() + 60)
        manager = process_manager_of(first.procs[0].pid)
        assert manager is not None, "rank 0 started no pmi_server.py"
        if with_secret:  # (g), (h): before the other ranks start
            for case in ("g", "h"):
                thread = stranger.guarded(case, lambda c: stranger.before_every_rank(c, size))
                thread.start()
                thread.join()
        others = start_self_started(control.command, np=size - 1, env=env,
                                    variables=lambda index: torchrun(index + 1))
        control.wait_until_up(first.procs + others.procs)
        rss_before = peak_rss_kib(manager)
        threads = [stranger.guarded(case, getattr(stranger, name))
                   for case, name in CASES.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        thread = stranger.guarded("d", stranger.hold)  # alone: it evicts the others' strangers
        thread.start()
        thread.join()
        if not with_secret:
            thread = stranger.guarded("proven", lambda c: stranger.proven_without_secret(c, size))
            thread.start()
            thread.join()
        stranger.still_answers("after")
        rss_peak = peak_rss_kib(manager)
    except Exception as error:  # noqa: BLE001 - shown below with every rank's output
        failure = error
    control.stop()
    results = [first.wait(120)] + ([others.wait(60)] if others is not None else [])
    described = "\n".join(result.describe() for result in results)
    assert failure is None, f"{failure!r}\n{described}"
    for result in results:
        assert not result.timed_out and result.returncode == 0, described
    outputs = [results[0].output(0)] + [results[1].output(r) for r in range(size - 1)]
    steps = set()
    for rank, output in enumerate(outputs):
        found = re.search(rf"TRAINED rank={rank} size={size} steps=(\d+) loss=\S+ weights "
                          "identical ok", output)
        assert found, described
        steps.add(found.group(1))
    assert len(steps) == 1, f"the ranks stopped at different steps: {steps}\n{described}"
    cases = [*(["g", "h"] if with_secret else ["proven"]), *CASES, "d", "after"]
    for case in cases:
        assert not stranger.problems.get(case), (
            f"case ({case}): " + "\n".join(stranger.problems[case][:20]))
    heard = {command for commands in stranger.lines_heard.values() for command in commands}
    assert heard <= ALLOWED, heard
    assert "kd_denied" in heard
    assert rss_peak < RSS_LIMIT_KIB, (
        f"the process manager's peak RSS grew from {rss_before} KiB to {rss_peak} KiB")
    print(f"process manager peak RSS: {rss_before} KiB before the attacks, {rss_peak} KiB "
          f"after; {int(steps.pop())} steps trained; seconds per case: "
          + ", ".join(f"{case} {seconds:.1f}" for case, seconds in stranger.seconds.items()))


class Flood:
    """Opens connections to ``port`` as fast as it can, holding the last
    ``held`` of them and never sending a byte, until stopped."""

    def __init__(self, port, held=400):
        self.port, self.held = port, held
        self.opened = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="flood", daemon=True)

    def _run(self):
        held = []
        try:
            while not self.stopping.is_set():
                sock = socket.socket()
                sock.setblocking(False)
                if sock.connect_ex(("127.0.0.1", self.port)) not in (0, errno.EINPROGRESS):
                    sock.close()
                    continue
                held.append(sock)
                self.opened += 1
                if len(held) > self.held:
                    held.pop(0).close()
        finally:
            for sock in held:
                sock.close()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self.thread.join()


@pytest.mark.timeout(150)
def test_a_connection_flood_during_start_up_ends_no_rank():
    """A stranger opening connections as fast as it can while the ranks greet
    and set up their watches: every rank must come (retrying when the server
    drops its unproven connection for a newer one) and train to the end."""
    port = free_port()
    env = {**QUIET, "KERAS_DIST_SECRET": SECRET, "KERAS_DIST_SECRET_FILE": None}
    control = Control()
    failure = None
    with Flood(port) as flood:
        job = start_self_started(control.command, np=2, env=env,
                                 variables=torchrun_variables(2, port))
        try:
            control.wait_until_up(job.procs)
        except Exception as error:  # noqa: BLE001 - shown below with every rank's output
            failure = error
    control.stop()
    result = job.wait(100)
    assert failure is None and result.returncode == 0 and not result.timed_out, (
        f"a flood of {flood.opened} connections during the start ended the job (a rank's "
        f"greeting or watch dropped by the server for a newer stranger must be tried again): "
        f"{failure!r}\n{result.describe()}")
    for rank in range(2):
        assert f"TRAINED rank={rank} size=2 " in result.output(rank), result.describe()
