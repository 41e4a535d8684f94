"""The process manager of self-started jobs, spoken to as MPICH and keras_dist
speak to it: greetings, PMI-1 (store, barrier, finalize, abort) and the watch
that tells every rank when one died."""

import os
import socket
import threading
import time
from urllib.parse import unquote

import pytest

from keras_dist._runtime import pmi_server, wire

SECRET = b"0123456789abcdef-test-secret"


class Job:
    """A server on a free port, run in a thread; ``connect`` gives a rank's socket.
    ``starter``: the read end of a pipe whose close stands for the end of the
    process that started the server (rank 0), as ``start_process_manager`` gives."""

    def __init__(self, size, timeout=60.0, secret=SECRET, starter=None):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.secret = secret
        self.server = pmi_server.Server(self.listener, size, timeout, secret, starter)
        self.exit_code = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        self.exit_code = self.server.serve()

    def connect(self, cmd, secret=None, **claim):
        """A connection that has proved the secret with ``claim``."""
        sock = socket.create_connection(self.address, timeout=30)
        reader = wire.authenticate(sock, self.secret if secret is None else secret, cmd,
                                   claim, time.monotonic() + 30)
        return Client(sock, reader)

    def finish(self):
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()
        return self.exit_code


class Client:
    def __init__(self, sock, reader):
        self.sock, self.reader = sock, reader

    def sendall(self, data):
        self.sock.sendall(data)

    def close(self):
        self.sock.close()


def send(sock, line):
    sock.sendall(line.encode() + b"\n")


def receive(sock):
    line = sock.reader.line(time.monotonic() + 30)
    return None if line is None else wire.parse_line(line)


def greet(job, rank, size, host="h"):
    return job.connect("kd_hello", rank=rank, size=size, host=host, pid=100 + rank)


def ready_ranks(job, size):
    socks = [greet(job, rank, size) for rank in range(size)]
    assert [receive(s)["cmd"] for s in socks] == ["kd_ready"] * size
    return socks


def test_every_rank_is_ready_once_all_have_come():
    job = Job(3)
    first = greet(job, 2, 3)
    others = [greet(job, 0, 3), greet(job, 1, 3)]
    for sock in [first, *others]:
        assert receive(sock) == {"cmd": "kd_ready"}
    for sock in [first, *others]:
        send(sock, "cmd=finalize")
        assert receive(sock)["cmd"] == "finalize_ack"
        sock.close()
    assert job.finish() == 0


@pytest.mark.parametrize("second, expected", [
    ((1, 3), "rank 1 (host h, pid 101) was told the job has 3 processes, rank 0 was told 2"),
    ((0, 2), "two processes claim rank 0: host h pid 100 and host h pid 100"),
])
def test_a_start_that_cannot_be_is_refused_to_every_process(second, expected):
    job = Job(2)
    sockets = [greet(job, 0, 2), greet(job, *second)]
    for sock in sockets:
        answer = receive(sock)
        assert answer["cmd"] == "kd_refuse" and expected in unquote(answer["message"])
    assert job.finish() == 1


def test_rank_0_greeting_after_the_rank_that_stopped_the_start_still_hears_why():
    read_end, write_end = os.pipe()
    with open(read_end, "rb", buffering=0) as starter:
        job = Job(2, starter=starter)
        outside = job.connect("kd_watch", rank=-1)  # an executor's watch
        early = greet(job, 1, 3)  # rank 1, told another world size, comes first
        expected = "rank 1 (host h, pid 101) was told the job has 3 processes, rank 0 was told 2"
        assert expected in unquote(receive(early)["message"])
        assert receive(outside) is None  # the watch ends with the start
        for rank in (0, 1):  # the server stays for rank 0, and says the same to whoever comes
            answer = receive(greet(job, rank, 2))
            assert answer["cmd"] == "kd_refuse" and expected in unquote(answer["message"])
        assert job.thread.is_alive()
        os.close(write_end)  # rank 0, having heard, ends: so does the server
        assert job.finish() == 1


def test_ranks_that_never_come_are_named_when_the_start_times_out():
    job = Job(3, timeout=0.5)
    sock = greet(job, 1, 3)
    answer = receive(sock)
    assert answer["cmd"] == "kd_refuse"
    assert unquote(answer["message"]).startswith(
        "ranks [0, 2] of 3 did not reach the rendezvous within 0.5 s "
        "(KERAS_DIST_RENDEZVOUS_TIMEOUT); those that came: rank 1 (host h, pid 101)")
    assert job.finish() == 1


def test_pmi_store_barrier_and_finalize_as_mpich_uses_them():
    job = Job(2)
    ranks = ready_ranks(job, 2)
    send(ranks[0], "cmd=init pmi_version=1 pmi_subversion=1")
    assert receive(ranks[0]) == {"cmd": "response_to_init", "pmi_version": "1",
                                 "pmi_subversion": "1", "rc": "0"}
    send(ranks[0], "cmd=get_my_kvsname")
    kvsname = receive(ranks[0])["kvsname"]
    send(ranks[1], "cmd=get_my_kvsname")
    assert receive(ranks[1])["kvsname"] == kvsname  # one store for the job
    other = pmi_server.Server(None, 1, 60.0, SECRET)  # another job, never served
    assert other.kvsname != kvsname  # MPICH names its segments after it
    other.close_all(flush_seconds=0)
    send(ranks[0], f"cmd=put kvsname={kvsname} key=card[0] value=tcp://a:1$x")
    assert receive(ranks[0])["rc"] == "0"
    send(ranks[1], f"cmd=get kvsname={kvsname} key=card[0]")
    assert receive(ranks[1])["value"] == "tcp://a:1$x"
    send(ranks[1], f"cmd=get kvsname={kvsname} key=missing")
    assert receive(ranks[1])["rc"] == "-1"
    send(ranks[0], "cmd=barrier_in")
    send(ranks[1], "cmd=get_universe_size")
    assert receive(ranks[1])["size"] == "2"  # rank 0 still waits in the barrier
    send(ranks[1], "cmd=barrier_in")
    assert [receive(s)["cmd"] for s in ranks] == ["barrier_out", "barrier_out"]
    for sock in ranks:
        send(sock, "cmd=finalize")
        assert receive(sock)["cmd"] == "finalize_ack"
        sock.close()
    assert job.finish() == 0


def watch(job, rank):
    return job.connect("kd_watch", rank=rank)  # registered once welcomed


def test_a_rank_that_dies_is_named_to_every_watching_rank():
    job = Job(3)
    ranks = ready_ranks(job, 3)
    watchers = [watch(job, rank) for rank in range(3)]
    send(ranks[0], "cmd=finalize")  # a rank that finished is no failure...
    assert receive(ranks[0])["cmd"] == "finalize_ack"
    ranks[0].close()
    ranks[2].close()  # ...one that vanishes before finishing is
    for rank in (0, 1):
        answer = receive(watchers[rank])
        assert answer["cmd"] == "kd_abort" and answer["rank"] == "2", answer
        assert unquote(answer["message"]).startswith(
            "rank 2 (host h, pid 102) ended before MPI finished")
    assert job.finish() == 1


def test_mpi_abort_on_one_rank_is_named_to_the_others():
    job = Job(2)
    ranks = ready_ranks(job, 2)
    watcher = watch(job, 0)
    send(ranks[1], "cmd=abort exitcode=1 message=application%20called%20abort")
    answer = receive(watcher)
    assert answer["cmd"] == "kd_abort" and answer["rank"] == "1"
    assert unquote(answer["message"]) == (
        "rank 1 (host h, pid 101) aborted the job (exit code 1): application called abort")
    assert job.finish() == 1


def test_a_latecomer_is_refused_and_the_running_job_goes_on():
    job = Job(2)
    ranks = ready_ranks(job, 2)
    late = greet(job, 1, 2)
    answer = receive(late)
    assert answer["cmd"] == "kd_refuse"
    assert "has started already" in unquote(answer["message"])
    send(ranks[0], "cmd=get_universe_size")
    assert receive(ranks[0])["size"] == "2"
    for sock in ranks:
        send(sock, "cmd=finalize")
        assert receive(sock)["cmd"] == "finalize_ack"
        sock.close()
    assert job.finish() == 0


def test_an_executor_watching_from_outside_hears_the_rank_that_died_first():
    from keras_dist._runtime import rendezvous

    job = Job(3)
    ranks = ready_ranks(job, 3)
    host, port = job.address
    outside = rendezvous.watch(host, port, SECRET)  # rank -1: Ray's and Spark's executors
    ranks[2].close()
    assert rendezvous.wait_for_failure(outside) == (
        2, "rank 2 (host h, pid 102) ended before MPI finished (its connection to the "
           "rendezvous closed): it died or exited without finishing")
    assert job.finish() == 1
    # A job that ends without a failure says nothing.
    clean = Job(1)
    (only,) = ready_ranks(clean, 1)
    quiet = rendezvous.watch(*clean.address, SECRET)
    send(only, "cmd=finalize")
    assert receive(only)["cmd"] == "finalize_ack"
    only.close()
    assert rendezvous.wait_for_failure(quiet) is None
    assert clean.finish() == 0
