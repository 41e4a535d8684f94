"""A stranger attacks the ports that Ray's and Spark's executors open, and gets
nothing; the job's own processes are served all along.

The parts run as the executors run them, without starting a cluster:

- Spark: the driver's relay (``clusters.spark.driver.DriverRelay``, a thread of
  the driver) that each barrier task reports to with ``TaskRelay``;
- Ray: the job's process manager that ``ProcessManagerActor`` runs beside
  rank 0 (``clusters.common.JobProcessManager``: ``pmi_server.py`` on a port
  bound once, and the executor's watch), greeted by two ranks that then speak
  PMI-1 to it as MPICH does.

The stranger (tests/faults/stranger.py) probes, sends HTTP, floods, sends
every command of the protocol with malformed fields and wrong macs, watches
and says ``abort``; before the ranks came it greets with another size and
claims their ranks. It must hear the challenge and ``kd_denied`` and nothing
else, and what the job's processes send must arrive as sent.
"""

import io
import socket
import time

import pytest

from keras_dist._runtime import wire
from keras_dist.clusters.common import JobProcessManager, new_secret
from keras_dist.clusters.spark import relay
from keras_dist.clusters.spark.driver import DriverRelay
from keras_dist.clusters.spark.task import Job, TaskRelay
from tests.faults.stranger import ALLOWED, Stranger

CASES = {"a": "open_and_close", "b": "http", "c": "flood", "e": "commands",
         "f": "watch_then_abort"}


def attack(stranger, cases):
    threads = [stranger.guarded(case, getattr(stranger, name)) for case, name in cases.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def assert_nothing_heard(stranger, cases):
    for case in cases:
        assert not stranger.problems.get(case), (
            f"case ({case}): " + "\n".join(stranger.problems[case][:20]))
    heard = {command for commands in stranger.lines_heard.values() for command in commands}
    assert heard <= ALLOWED and "kd_denied" in heard, heard


@pytest.mark.timeout(120)
def test_sparks_driver_relay_serves_only_its_tasks():
    secret = new_secret()
    stdout, stderr = io.StringIO(), io.StringIO()
    driver = DriverRelay(2, secret, stdout, stderr, verbose=1)
    try:
        stranger = Stranger(driver.port)
        with socket.create_connection(("127.0.0.1", driver.port), timeout=30) as probe:
            probe.sendall(b"GET / HTTP/1.1\r\n\r\n")
            heard = probe.recv(4096)
            while b"kd_denied" not in heard and (data := probe.recv(4096)):
                heard += data
        driver.thread.join(0.5)  # its loop steps at least every 0.2 s: a failure shows by then
        assert driver.thread.is_alive(), (
            "the driver's relay stopped serving after one HTTP probe")
        attack(stranger, CASES)
        assert driver.thread.is_alive(), (
            "the driver's relay stopped serving after the stranger's attacks")
        # A stranger's records, without a proof, and a pickle: never read.
        stranger.say("records", "an outcome record without a proof",
                     relay.encode({"outcome": {"where": "evil", "summary": "stranger"}}),
                     denied=True)
        stranger.say("records", "a pickle", b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00"
                     b"\x8c\x02os\x94\x8c\x06system\x94\x93\x94.\n", denied=True)
        # The run's tasks report through the same port, as barrier tasks do.
        job = Job(payload=b"", size=2, env={}, secret=secret, driver=("127.0.0.1", driver.port))
        for rank in range(2):
            with TaskRelay(job, rank) as task:
                assert task.sock is not None, f"rank {rank}'s task could not reach the driver"
                task.started(1000 + rank, "host", "127.0.0.1:1")
                task.line("stdout", f"hello from rank {rank}")
                task.report(relay.Outcome(f"pid {1000 + rank} on host"))
        driver.wait_for_reports(30, unheard=30)  # until both tasks reported and left
        assert driver.thread.is_alive(), "the driver's relay stopped serving"
    finally:
        driver.stop()
    assert_nothing_heard(stranger, [*CASES, "records"])
    assert sorted(driver.outcomes) == [0, 1] and sorted(driver.started) == [0, 1]
    assert all(outcome["summary"] is None for outcome in driver.outcomes.values())
    assert "[0] hello from rank 0\n" in stdout.getvalue()
    assert "[1] hello from rank 1\n" in stdout.getvalue()
    assert "stranger" not in stdout.getvalue() + stderr.getvalue()


def greet(port, secret, rank, size):
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    reader = wire.authenticate(sock, secret, "kd_hello",
                               {"rank": rank, "size": size, "host": "h", "pid": rank},
                               time.monotonic() + 30)
    return sock, reader


def ask(sock, reader, line):
    sock.sendall(line)
    return wire.parse_line(reader.line(time.monotonic() + 30))


@pytest.mark.timeout(120)
def test_rays_process_manager_serves_only_its_ranks():
    secret = new_secret()
    manager = JobProcessManager(2, 60.0, secret)
    ranks = []
    try:
        stranger = Stranger(manager.port)
        for case in ("g", "h"):  # before the ranks came
            thread = stranger.guarded(case, lambda case: stranger.before_every_rank(case, 2))
            thread.start()
            thread.join()
        ranks = [greet(manager.port, secret.encode(), rank, 2) for rank in range(2)]
        for _, reader in ranks:
            assert wire.parse_line(reader.line(time.monotonic() + 30)) == {"cmd": "kd_ready"}
        attack(stranger, CASES)
        # The ranks' PMI-1, as MPICH speaks it, after the attacks.
        (first, first_reader), (second, second_reader) = ranks
        assert ask(first, first_reader, b"cmd=put key=card0 value=shm-0\n")["rc"] == "0"
        assert ask(second, second_reader, b"cmd=get key=card0\n")["value"] == "shm-0"
        for sock, _ in ranks:
            sock.sendall(b"cmd=barrier_in\n")
        for sock, reader in ranks:
            assert wire.parse_line(reader.line(time.monotonic() + 30))["cmd"] == "barrier_out"
            assert ask(sock, reader, b"cmd=finalize\n")["cmd"] == "finalize_ack"
            sock.close()
        # The executor's watch hears no failure: the job ended cleanly.
        assert manager.first_failure() is None
        assert manager.manager.wait(30) == 0
    finally:
        for sock, _ in ranks:
            sock.close()
        manager.close()
    assert_nothing_heard(stranger, ["g", "h", *CASES])
