"""Where a process that started itself stands: torchrun's and Kubeflow's
variables, and init()'s arguments, read exactly as those clusters set them."""

import pytest

from keras_dist._runtime import placement
from keras_dist._runtime.placement import Placement


def torchrun(rank, size=4, local=None, **extra):
    env = {"RANK": str(rank), "WORLD_SIZE": str(size), "MASTER_ADDR": "10.0.0.5",
           "MASTER_PORT": "29500", "GROUP_RANK": "0", "ROLE_RANK": str(rank)}
    if local is not None:
        env.update(LOCAL_RANK=str(local), LOCAL_WORLD_SIZE="2")
    env.update(extra)
    return env


def test_torchrun_variables_give_rank_size_and_rank_zeros_address():
    found = placement.from_environment(torchrun(3, local=1))
    assert found == Placement(3, 4, "10.0.0.5", 29500, 1, "torchrun's variables")
    assert found.address == "10.0.0.5:29500"


def test_under_torchruns_agent_store_the_rendezvous_is_one_port_above():
    found = placement.from_environment(torchrun(0, TORCHELASTIC_USE_AGENT_STORE="True",
                                                TORCHELASTIC_RUN_ID="job"))
    assert found.port == 29501 and "MASTER_PORT + 1" in found.source


def test_no_variables_or_an_mpi_launcher_give_no_placement():
    assert placement.from_environment({}) is None
    assert placement.from_environment({"MASTER_ADDR": "x"}) is None  # torch alone sets it
    # kdrun/mpiexec (Hydra) set PMI_*: MPI's own launcher wins over leftover variables.
    for launcher in ({"PMI_FD": "9", "PMI_RANK": "1"}, {"PMIX_RANK": "0"},
                     {"OMPI_COMM_WORLD_RANK": "0"}):
        assert placement.from_environment({**torchrun(1), **launcher}) is None


@pytest.mark.parametrize("drop", ["MASTER_ADDR", "MASTER_PORT"])
def test_incomplete_torchrun_variables_name_what_is_missing(drop):
    env = torchrun(1)
    del env[drop]
    with pytest.raises(ValueError, match=f"torchrun's variables are incomplete: {drop} is not"):
        placement.from_environment(env)


@pytest.mark.parametrize("changes, message", [
    ({"RANK": "4"}, r"`RANK` must be in \[0, WORLD_SIZE\). Received: RANK=4 \(WORLD_SIZE=4"),
    ({"WORLD_SIZE": "0"}, r"`WORLD_SIZE` must be a whole number >= 1. Received: WORLD_SIZE='0'"),
    ({"RANK": "-1"}, r"`RANK` must be a whole number >= 0. Received: RANK='-1'"),
    ({"MASTER_PORT": "70000"}, r"`MASTER_PORT` must be a port in \[1, 65535\]"),
    ({"MASTER_PORT": "http"}, r"`MASTER_PORT` must be a whole number >= 1"),
    ({"LOCAL_RANK": "x"}, r"`LOCAL_RANK` must be a whole number >= 0"),
])
def test_bad_torchrun_values_say_what_was_expected_and_received(changes, message):
    with pytest.raises(ValueError, match=message):
        placement.from_environment({**torchrun(1), **changes})


def kubeflow(node_rank, nodes=2, per_node=None, **extra):
    env = {"PET_NNODES": str(nodes), "PET_NODE_RANK": str(node_rank),
           "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29400"}
    if per_node is not None:
        env["PET_NPROC_PER_NODE"] = str(per_node)
    env.update(extra)
    return env


def test_kubeflow_trainer_variables_one_process_a_pod():
    found = placement.from_environment(kubeflow(1, per_node=1))
    assert found == Placement(1, 2, "job-node-0-0.job", 29400, None,
                              "Kubeflow Trainer's variables")


def test_kubeflow_several_processes_a_node_need_a_local_rank():
    assert placement.from_environment(kubeflow(1, per_node=2, LOCAL_RANK="1")).rank == 3
    with pytest.raises(ValueError, match="PET_NPROC_PER_NODE=2 asks for 2 processes"):
        placement.from_environment(kubeflow(1, per_node=2))
    with pytest.raises(ValueError, match=r"`PET_NODE_RANK` must be in \[0, PET_NNODES\)"):
        placement.from_environment(kubeflow(2))


def test_torchrun_variables_win_over_kubeflows():
    # A TrainJob pod that runs torchrun has both: torchrun's say which process this is.
    found = placement.from_environment({**kubeflow(1, per_node=2), **torchrun(3, local=1)})
    assert found.source == "torchrun's variables" and found.rank == 3


def test_init_arguments():
    assert placement.from_arguments("node-a:1234", 1, 2) == Placement(
        1, 2, "node-a", 1234, None, "init() arguments")
    assert placement.from_arguments("[::1]:80", 0, 1, local_rank=0).host == "::1"
    with pytest.raises(ValueError, match="needs `rank` and `size` too"):
        placement.from_arguments("a:1", None, 2)
    with pytest.raises(ValueError, match=r"`rendezvous` must be \"host:port\". Received: "
                                         r"rendezvous='nohost'"):
        placement.from_arguments("nohost", 0, 2)
    with pytest.raises(ValueError, match=r"`rank` must be in \[0, size\). Received: rank=2"):
        placement.from_arguments("a:1", 2, 2)
    with pytest.raises(ValueError, match="`size` must be a whole number >= 1"):
        placement.from_arguments("a:1", 0, 1.5)


def test_an_mpi_that_did_not_take_the_rendezvous_is_named():
    from keras_dist._runtime import rendezvous
    from keras_dist.errors import RendezvousError

    place = placement.from_arguments("a:1", 1, 2)
    rendezvous.check_world(place, 2, "MPICH Version: 5.0.2\nMPICH Release date: ...")
    with pytest.raises(RendezvousError, match=r"rank 1: the rendezvous formed a job of 2 "
                       r"processes, but MPI started a world of 1 "
                       r"\(Open MPI v5.0.3, package: Open MPI\)"):
        rendezvous.check_world(place, 1, "Open MPI v5.0.3, package: Open MPI\nmore")
    rendezvous.check_local_rank(placement.from_arguments("a:1", 1, 2, local_rank=1), 1)
    with pytest.raises(RendezvousError, match="give LOCAL_RANK=0, but it is local rank 1"):
        rendezvous.check_local_rank(placement.from_arguments("a:1", 1, 2, local_rank=0), 1)


@pytest.mark.parametrize("env, job, launch", [
    ({"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_MAX_RESTARTS": "3",
      "TORCHELASTIC_RESTART_COUNT": "2"}, "torchrun-abc", 2),
    # torchrun's default run id is the same for every run: not elastic
    ({"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_MAX_RESTARTS": "3"}, None, 0),
    ({"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_MAX_RESTARTS": "0"}, None, 0),
    # kdrun's own say wins
    ({"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_MAX_RESTARTS": "3",
      "KERAS_DIST_ELASTIC_JOB": "kd", "KERAS_DIST_ELASTIC_ROUND": "4"}, "kd", 4),
])
def test_torchruns_restarts_are_an_elastic_jobs_launches(monkeypatch, env, job, launch):
    from keras_dist._config import Config

    for name in ("KERAS_DIST_ELASTIC_JOB", "KERAS_DIST_ELASTIC_ROUND", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = Config.from_env()
    assert (config.elastic_job, config.elastic_round) == (job, launch)
