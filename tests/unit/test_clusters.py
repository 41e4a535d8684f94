"""The cluster executors' parts that need no cluster: Ray's placement
arithmetic, a Spark task's place and environment, the shared process manager
(with its secret) and the first-failure watch."""

import os
import socket
import threading

import pytest

from keras_dist._runtime import wire
from keras_dist.clusters import common
from keras_dist.clusters.ray.layout import Slot, rank_order, visible_gpus
from keras_dist.clusters.spark.task import place_from_addresses, process_environment


def test_ranks_of_a_node_are_consecutive():
    # PACK put bundles 0 and 2 on node a, 1 on node b: ranks 0, 1 on a, 2 on b.
    assert rank_order({0: "a", 1: "b", 2: "a"}, 1) == [0, 2, 1]
    assert rank_order({0: "b", 1: "a"}, 2) == [0, 0, 1, 1]


def test_each_ray_worker_sees_the_gpus_of_its_machine_in_local_rank_order():
    def slot(host, *gpus):
        return Slot(ip="10.0.0.1", hostname=host, gpu_ids=gpus)

    slots = [slot("a", "3"), slot("a", "1"), slot("b", "0"), slot("b", "2", "5")]
    assert visible_gpus(slots) == ["3,1", "3,1", "0,2,5", "0,2,5"]


def test_a_spark_task_counts_local_ranks_per_host_in_rank_order():
    addresses = ["10.0.0.1:40001", "10.0.0.2:40002", "10.0.0.1:40003", "[fd00::5]:7"]
    places = [place_from_addresses(rank, addresses, 29500) for rank in range(4)]
    assert [place.local_rank for place in places] == [0, 0, 1, 0]
    assert {place.host for place in places} == {"10.0.0.1"}
    assert [place.rank for place in places] == [0, 1, 2, 3]
    assert {place.size for place in places} == {4}


def test_a_spark_ranks_environment():
    place = place_from_addresses(1, ["h0:1", "h1:2"], 29500)
    base = {"PATH": "/bin", "PMI_FD": "5", "TORCHELASTIC_USE_AGENT_STORE": "True", "RANK": "7",
            "PYTHONPATH": "/executor"}
    environment = process_environment(base, {"PYTHONPATH": "/user", "RANK": "9", "X": "1"},
                                      place, ["/task", "", "/user"])
    # An MPI launcher's or torchrun agent's variables would make kd.init() look elsewhere.
    assert "PMI_FD" not in environment and "TORCHELASTIC_USE_AGENT_STORE" not in environment
    assert {name: environment[name] for name in
            ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h0",
        "MASTER_PORT": "29500"}
    assert environment["X"] == "1" and environment["PATH"] == "/bin"
    # The run's env first, then what the task could import.
    assert environment["PYTHONPATH"] == os.pathsep.join(["/user", "/task"])
    assert environment["PYTHONUNBUFFERED"] == "1"


def test_a_job_secret_is_fresh_and_long():
    first, second = common.new_secret(), common.new_secret()
    assert first != second and len(bytes.fromhex(first)) == 32
    assert common.rank_environment(first) == {
        "KERAS_DIST_SECRET": first, "KERAS_DIST_RENDEZVOUS_SERVED_BY_LAUNCHER": "1"}


def _hello(port, secret, rank, size):
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    reader = wire.authenticate(sock, secret.encode(), "kd_hello",
                               {"rank": rank, "size": size, "host": "h", "pid": rank}, None)
    return sock, reader


@pytest.mark.timeout(60)
def test_the_executors_process_manager_admits_the_secret_only_and_names_the_failed_rank():
    secret = common.new_secret()
    job = common.JobProcessManager(2, 30.0, secret)
    try:
        with pytest.raises(wire.DeniedError):
            _hello(job.port, common.new_secret(), 0, 2)
        ranks = [_hello(job.port, secret, rank, 2) for rank in range(2)]
        assert [wire.parse_line(reader.line(None)) for _, reader in ranks] == [
            {"cmd": "kd_ready"}] * 2
        word = []
        listener = threading.Thread(target=lambda: word.append(job.first_failure()))
        listener.start()
        ranks[1][0].close()  # rank 1 vanishes before finishing MPI
        listener.join(30)
        assert word and word[0][0] == 1, word
        assert "rank 1 (host h, pid 1) ended before MPI finished" in word[0][1]
        ranks[0][0].close()
    finally:
        job.close()
    assert job.manager.wait(30) == 1  # the manager ended with the job


@pytest.mark.timeout(60)
def test_a_process_manager_whose_executor_lets_go_before_the_start_ends():
    job = common.JobProcessManager(2, 300.0, common.new_secret())
    job.close()  # the executor gave up (its task was stopped) before any rank came
    assert job.manager.wait(30) == 1
