"""Process sets in one process: arguments, registration rules, errors, settings."""

import dataclasses

import numpy as np
import pytest

import keras_dist as kd
from keras_dist import process_sets
from keras_dist._config import Config
from keras_dist._runtime import context


@pytest.fixture(scope="module", autouse=True)
def dynamic_group():
    kd.shutdown()  # another module's group, if any
    kd.init(process_sets="dynamic")
    yield
    kd.shutdown()


@pytest.mark.parametrize(("ranks", "message"), [
    ("01", "list of ranks or an mpi4py communicator"),
    (3, "list of ranks or an mpi4py communicator"),
    ([0, 1.5], r"must be integers. Received: ranks=\[0, 1.5\]"),
    ([True], "must be integers"),
    ([2, -1], r"must be >= 0. Received: ranks=\[-1, 2\]"),
    ([1, 0, 1], r"must be distinct. Received: ranks=\[0, 1, 1\] \(repeated: \[1\]\)"),
])
def test_bad_ranks_are_explained(ranks, message):
    with pytest.raises(ValueError, match=message):
        kd.ProcessSet(ranks)


def test_a_new_set_is_sorted_and_unregistered():
    the_set = kd.ProcessSet(np.array([3, 1, 2]))
    assert the_set.ranks == [1, 2, 3] and all(type(r) is int for r in the_set.ranks)
    assert (the_set.process_set_id, the_set.size(), the_set.rank()) == (None, None, None)
    assert the_set.included() is False  # rank 0 is not in it
    assert repr(the_set) == "ProcessSet(process_set_id=None, ranks=[1, 2, 3], mpi_comm=None)"
    assert kd.ProcessSet(range(2)) != kd.ProcessSet(range(2))  # identity, not ranks


def test_mpi_objects_other_than_communicators_are_refused():
    from mpi4py import MPI

    with pytest.raises(ValueError, match="Received: Group"):
        kd.ProcessSet(MPI.COMM_WORLD.Get_group())
    with pytest.raises(ValueError, match="COMM_NULL"):
        kd.ProcessSet(MPI.COMM_NULL)
    with pytest.raises(NotImplementedError, match="init\\(comm, process_sets"):
        kd.add_process_set(kd.ProcessSet(MPI.COMM_WORLD))


def test_global_set_at_size_one():
    assert repr(kd.global_process_set) == (
        "ProcessSet(process_set_id=0, ranks=[0], mpi_comm=None)")
    assert (kd.global_process_set.size(), kd.global_process_set.rank()) == (1, 0)
    assert kd.global_process_set.included() is True
    assert context.group_for(kd.global_process_set) is context.get()
    assert context.group_for(None) is context.get()
    assert process_sets.by_id(0) is kd.global_process_set
    assert process_sets.registered() == {0: [0]}


def test_duplicates_and_ranks_outside_the_job_are_refused():
    with pytest.raises(ValueError, match="duplicate process set.*process set 0"):
        kd.add_process_set([0])
    with pytest.raises(ValueError, match=r"must be in \[0, 1\).*Received: ranks=\[0, 1\]"):
        kd.add_process_set([0, 1])
    with pytest.raises(ValueError, match="at least one rank"):
        kd.add_process_set([])
    assert process_sets.registered() == {0: [0]}


def test_removal_of_what_is_not_registered_is_false():
    assert kd.remove_process_set(kd.global_process_set) is False
    assert kd.remove_process_set(kd.ProcessSet([0])) is False
    stale = kd.ProcessSet([0])
    stale.process_set_id = 4
    assert kd.remove_process_set(stale) is False
    assert stale.process_set_id is None
    with pytest.raises(ValueError, match="takes a keras_dist.ProcessSet"):
        kd.remove_process_set([0])


def test_unregistered_sets_and_ids_are_explained():
    fake = kd.ProcessSet([0])
    fake.process_set_id = 10
    for call in (lambda: context.group_for(fake), fake.size, fake.rank,
                 lambda: kd.allreduce(np.ones(2), process_set=fake),
                 lambda: process_sets.by_id(10)):
        with pytest.raises(ValueError, match=r"is not registered \(call add_process_set"):
            call()
    with pytest.raises(ValueError, match="must be an integer. Received: process_set_id='1'"):
        process_sets.by_id("1")
    with pytest.raises(ValueError, match=r"must be a keras_dist.ProcessSet. Received: \[0\]"):
        context.group_for([0])


@pytest.mark.parametrize(("argument", "message"), [
    ("static", 'list of ProcessSet or "dynamic". Received: process_sets=\'static\''),
    (5, 'list of ProcessSet or "dynamic". Received: int'),
    ([[0]], "must hold ProcessSet objects. Received: list at position 0"),
    ([kd.global_process_set], "must not hold `global_process_set`"),
])
def test_bad_init_arguments_are_explained(argument, message):
    with pytest.raises(ValueError, match=message):
        process_sets.parse_init_argument(argument)


def test_init_arguments():
    assert process_sets.parse_init_argument(None) == ([], False)
    assert process_sets.parse_init_argument("Dynamic") == ([], True)
    the_set = kd.ProcessSet([0])
    assert process_sets.parse_init_argument((the_set,)) == ([the_set], False)


def test_static_sets_are_checked_on_every_rank_alike():
    job = dataclasses.replace(context.get(), process_sets={})
    for entries, message in (
        ([kd.ProcessSet([0])], "entry number 0 is a duplicate of process set 0"),
        ([kd.ProcessSet([1])], r"entry number 0 on rank 0: process set ranks must be in \[0, 1\)"),
        ([kd.ProcessSet([])], "entry number 0 on rank 0: a process set needs at least one rank"),
    ):
        with pytest.raises(ValueError, match=message):
            process_sets.register_at_init(job, entries, None)
    assert job.process_sets == {}


@pytest.mark.parametrize(("environ", "dynamic"), [
    ({}, False),
    ({"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}, True),
    ({"KERAS_DIST_DYNAMIC_PROCESS_SETS": "1"}, True),
    ({"KERAS_DIST_DYNAMIC_PROCESS_SETS": "0", "HOROVOD_DYNAMIC_PROCESS_SETS": "1"}, False),
])
def test_dynamic_setting(monkeypatch, environ, dynamic):
    for name in ("KERAS_DIST_DYNAMIC_PROCESS_SETS", "HOROVOD_DYNAMIC_PROCESS_SETS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert Config.from_env().dynamic_process_sets is dynamic


def test_dynamic_setting_must_be_a_number(monkeypatch):
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "yes")
    with pytest.raises(ValueError, match="`HOROVOD_DYNAMIC_PROCESS_SETS` must be a number"):
        Config.from_env()


def test_sets_are_gated_without_dynamic_process_sets():
    kd.shutdown()
    kd.init()
    try:
        for call in (lambda: kd.add_process_set([0]),
                     lambda: kd.remove_process_set(_registered_looking_set())):
            with pytest.raises(ValueError, match=(
                    "needs dynamic process sets. Set KERAS_DIST_DYNAMIC_PROCESS_SETS=1")):
                call()
    finally:
        kd.shutdown()
        kd.init(process_sets="dynamic")


def _registered_looking_set():
    the_set = kd.ProcessSet([0])
    the_set.process_set_id = 3
    return the_set
