"""Process sets, checked on every rank: ``process_sets.py static|dynamic|env|comm``.

    static   init(process_sets=[even, odd(, low)]): registration, collectives on
             each set against numpy float64 references built from the members'
             data only, overlapping sets, non-members busy elsewhere, errors
    dynamic  init(process_sets="dynamic"): add/remove, ids, duplicates,
             collectives on added sets, nothing left mapped or in /dev/shm
    env      the same as dynamic, enabled by HOROVOD_DYNAMIC_PROCESS_SETS=1
    comm     init(COMM_WORLD, process_sets=[ProcessSet(split communicator)])

Every rank can regenerate every rank's data (seeded by case and job rank).
Prints "PSETS <check> passed rank=R" per check.
"""

import glob
import os
import sys

import numpy as np
from mpi4py import MPI

import keras_dist as kd
from keras_dist import process_sets
from keras_dist._runtime import context
from tests.multiprocess.workers._checks import run_checks

MODE = sys.argv[1]
WORLD = MPI.COMM_WORLD
SIZE = WORLD.Get_size()
RANK = WORLD.Get_rank()
SEGMENTS = f"/dev/shm/kd-{os.getuid()}-"

even = kd.ProcessSet(range(0, SIZE, 2))
odd = kd.ProcessSet(range(1, SIZE, 2))
# Overlaps both parities (only at 3 ranks or more: at 2 it would be the job).
low = kd.ProcessSet([0, 1]) if SIZE >= 3 else None

if MODE == "static":
    kd.init(process_sets=[s for s in (even, odd, low) if s is not None])
elif MODE == "dynamic":
    kd.init(process_sets="dynamic")
elif MODE == "env":
    assert os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") == "1"
    kd.init()
elif MODE == "comm":
    split = WORLD.Split(color=RANK % 2, key=RANK)
    by_comm = kd.ProcessSet(split)
    kd.init(WORLD, process_sets=[by_comm])
else:
    raise SystemExit(f"unknown mode {MODE!r}")
assert kd.size() == SIZE and kd.rank() == RANK


def data(case, rank, count, dtype=np.float64):
    rng = np.random.default_rng([case, rank])
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-1000, 1000, count).astype(dtype)
    return rng.uniform(0.5, 1.5, count).astype(dtype)


def reference(op, case, ranks, count, dtype):
    stacked = np.stack([data(case, r, count, dtype).astype(np.float64) for r in ranks])
    if op is kd.Sum:
        return stacked.sum(0)
    if op is kd.Average:
        return stacked.mean(0)
    if op is kd.Max:
        return stacked.max(0)
    return stacked.min(0)


def check_allreduces(the_set, first_case):
    """Allreduces on ``the_set`` against references from its members' data only."""
    case = first_case
    for dtype, rtol in ((np.float64, 1e-12), (np.float32, 1e-5), (np.int64, 0)):
        for op in (kd.Sum, kd.Average, kd.Max, kd.Min):
            if op is kd.Average and np.dtype(dtype).kind == "i":
                continue
            for count in (1, 1000, 300_001):
                case += 1
                got = kd.allreduce(data(case, RANK, count, dtype), op=op,
                                   process_set=the_set)
                want = reference(op, case, the_set.ranks, count, dtype)
                assert got.dtype == np.dtype(dtype), (got.dtype, dtype)
                assert np.allclose(got.astype(np.float64), want, rtol=rtol, atol=0), (
                    f"{the_set} {op} {np.dtype(dtype).name} {count}: max error "
                    f"{np.max(np.abs(got - want))}")


def mapped_segments():
    """Shared-memory segments of keras_dist mapped into this process."""
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-2] if line.rstrip().endswith("(deleted)")
                       else line.split()[-1] for line in maps if SEGMENTS in line})


def my_parity_set():
    return even if RANK % 2 == 0 else odd


# ---------------------------------------------------------------------------
# static


def test_registration():
    sets = [s for s in (even, odd, low) if s is not None]
    assert [s.process_set_id for s in sets] == list(range(1, len(sets) + 1)), sets
    assert process_sets.registered() == {0: list(range(SIZE)),
                                         **{s.process_set_id: s.ranks for s in sets}}
    assert repr(kd.global_process_set) == (
        f"ProcessSet(process_set_id=0, ranks={list(range(SIZE))}, mpi_comm=None)")
    assert repr(even) == f"ProcessSet(process_set_id=1, ranks={even.ranks}, mpi_comm=None)"
    for s in sets:
        # size() everywhere, rank() on members only.
        assert s.size() == len(s.ranks)
        assert s.included() == (RANK in s.ranks)
        if s.included():
            assert s.rank() == s.ranks.index(RANK)
            group = context.group_for(s)
            assert (group.rank, group.size, group.ranks) == (s.rank(), s.size(),
                                                             tuple(s.ranks))
            assert group.transport is not context.get().transport
            assert group.comm != context.get().comm
        found = process_sets.by_id(s.process_set_id)
        assert (found.process_set_id, found.ranks) == (s.process_set_id, s.ranks)
    if context.get().transport.name == "shm":
        # One segment for the job and one per shared set this rank is in, none else.
        shared = [s for s in sets if s.included() and s.size() > 1]
        assert len(mapped_segments()) == 1 + len(shared), (mapped_segments(), shared)
        for s in shared:
            assert context.group_for(s).transport.name == "shm"
    assert process_sets.by_id(0) is kd.global_process_set
    assert kd.global_process_set.size() == SIZE and kd.global_process_set.rank() == RANK
    assert context.group_for(kd.global_process_set) is context.get()


def test_allreduce_on_each_parity():
    check_allreduces(my_parity_set(), 0)


def test_allgather_and_objects_on_each_parity():
    the_set = my_parity_set()
    rows = {r: 1 + r for r in the_set.ranks}  # first dimensions differ
    mine = data(500, RANK, rows[RANK] * 3).reshape(rows[RANK], 3)
    got = kd.allgather(mine, process_set=the_set)
    want = np.concatenate([data(500, r, rows[r] * 3).reshape(rows[r], 3)
                           for r in the_set.ranks])
    assert np.array_equal(got, want), (got, want)
    assert kd.allgather_object({"rank": RANK}, process_set=the_set) == [
        {"rank": r} for r in the_set.ranks]
    kd.barrier(process_set=the_set)


def test_broadcast_on_set_transport():
    """Each member as root, on the set's own transport (roots are set ranks there)."""
    the_set = my_parity_set()
    group = context.group_for(the_set)
    for root, root_rank in enumerate(the_set.ranks):
        buf = data(600 + root_rank, RANK, 10_000)
        group.transport.broadcast(buf, root, name="broadcast test")
        assert np.array_equal(buf, data(600 + root_rank, root_rank, 10_000))


def test_public_broadcasts_take_job_roots():
    """``root_rank`` of a set's broadcasts is a job rank, as in Horovod; ``join``
    on a set returns a job rank too; a root outside the set is refused."""
    the_set = my_parity_set()
    for root_rank in the_set.ranks:
        got = kd.broadcast(data(650 + root_rank, RANK, 300), root_rank, process_set=the_set)
        assert np.array_equal(got, data(650 + root_rank, root_rank, 300))
        assert kd.broadcast_object(("from", RANK), root_rank, process_set=the_set) == \
            ("from", root_rank)
    outsider = next((r for r in range(SIZE) if r not in the_set.ranks), None)
    if outsider is not None:
        try:
            kd.broadcast(np.ones(3), outsider, process_set=the_set)
        except ValueError as error:
            assert "process set's ranks" in str(error), error
        else:
            raise AssertionError("a root outside the set was accepted")
    if RANK == max(the_set.ranks):
        # Joins last, whatever the timing: this allreduce completes only once
        # every other member has joined (they add zeros to it from inside join).
        got = kd.allreduce(np.ones(4), op=kd.Sum, process_set=the_set)
        assert np.array_equal(got, np.ones(4)), got
    assert kd.join(process_set=the_set) == max(the_set.ranks)


def test_overlapping_sets():
    if low is None:
        return
    # Rank 0 alternates between two sets it shares with different peers.
    for step in range(5):
        if RANK in low.ranks:
            got = kd.allreduce(data(700 + step, RANK, 5000), op=kd.Sum, process_set=low)
            assert np.allclose(got, reference(kd.Sum, 700 + step, low.ranks, 5000,
                                              np.float64), rtol=1e-12)
        if RANK in even.ranks:
            got = kd.allreduce(data(800 + step, RANK, 5000), op=kd.Sum, process_set=even)
            assert np.allclose(got, reference(kd.Sum, 800 + step, even.ranks, 5000,
                                              np.float64), rtol=1e-12)


def test_non_members_never_block():
    """While rank 1 sits in a receive only the even set's lowest rank ends, the
    even ranks complete their set's collectives without it."""
    if RANK == 1:
        assert WORLD.recv(source=0, tag=77) == "even set done"
    elif RANK in even.ranks:
        check_allreduces(even, 900)
        if RANK == 0 and SIZE > 1:
            WORLD.send("even set done", dest=1, tag=77)
    kd.barrier()


def test_errors():
    outsider = odd if RANK % 2 == 0 else even
    if outsider.ranks:
        try:
            kd.allreduce(np.ones(4), process_set=outsider)
        except ValueError as error:
            assert f"rank {RANK} is not in process set {outsider.process_set_id}" in str(error)
        else:
            raise AssertionError("a non-member's collective did not raise")
    fake = kd.ProcessSet([0])
    fake.process_set_id = 10
    for call in (lambda: kd.allreduce(np.ones(4), process_set=fake), fake.size,
                 lambda: process_sets.by_id(10)):
        try:
            call()
        except ValueError as error:
            assert "is not registered" in str(error), error
        else:
            raise AssertionError("an unregistered set did not raise")
    for call in (lambda: kd.add_process_set([0]), lambda: kd.remove_process_set(even)):
        try:
            call()
        except ValueError as error:
            assert "KERAS_DIST_DYNAMIC_PROCESS_SETS=1" in str(error), error
        else:
            raise AssertionError("dynamic process sets were not gated")
    assert even.process_set_id == 1  # a refused removal leaves the set alone
    kd.barrier()


# ---------------------------------------------------------------------------
# dynamic and env


def test_add_get_remove():
    assert process_sets.registered() == {0: list(range(SIZE))}
    first = kd.add_process_set([0])
    rest = kd.add_process_set(range(1, SIZE))
    assert (first.process_set_id, rest.process_set_id) == (1, 2)
    assert process_sets.registered() == {0: list(range(SIZE)), 1: [0],
                                         2: list(range(1, SIZE))}
    for the_set in (first, rest):
        assert kd.allgather_object(the_set.process_set_id) == [the_set.process_set_id] * SIZE
    assert [str(p) for p in (kd.global_process_set, first, rest)] == [
        f"ProcessSet(process_set_id=0, ranks={list(range(SIZE))}, mpi_comm=None)",
        "ProcessSet(process_set_id=1, ranks=[0], mpi_comm=None)",
        f"ProcessSet(process_set_id=2, ranks={list(range(1, SIZE))}, mpi_comm=None)",
    ]
    assert kd.remove_process_set(first) is True
    assert first.process_set_id is None
    assert kd.remove_process_set(first) is False  # no longer registered
    assert process_sets.registered() == {0: list(range(SIZE)), 2: list(range(1, SIZE))}
    assert kd.add_process_set(first) is first and first.process_set_id == 1
    kd.remove_process_set(first)
    for duplicate in (range(SIZE - 1, 0, -1), range(SIZE)):
        try:
            kd.add_process_set(duplicate)
        except ValueError as error:
            assert "duplicate" in str(error), error
        else:
            raise AssertionError(f"a duplicate of {list(duplicate)} was added")
    if SIZE > 2:
        third = kd.add_process_set([0, SIZE - 1])
        assert third.process_set_id == 1  # the freed id is reused
        assert kd.remove_process_set(third)
    assert kd.remove_process_set(rest)
    assert kd.remove_process_set(kd.global_process_set) is False
    assert process_sets.registered() == {0: list(range(SIZE))}


def test_collectives_on_added_sets():
    before = mapped_segments()
    for round_ in range(3):
        the_set = kd.add_process_set(range(round_ % 2, SIZE, 2))
        if the_set.included():
            check_allreduces(the_set, 1000 * (round_ + 1))
            got = kd.allgather(np.array([RANK]), process_set=the_set)
            assert got.tolist() == the_set.ranks
        group = context.group_for(the_set) if the_set.included() else None
        on_shm = group is not None and group.size > 1 and group.transport.name == "shm"
        if context.get().transport.name == "shm":
            # A member of a shared set maps its segment; a non-member maps nothing more.
            assert len(mapped_segments()) == len(before) + on_shm, (mapped_segments(), before)
        assert kd.remove_process_set(the_set)
        if on_shm:
            try:
                group.transport.allreduce(np.ones(3), 0)
            except kd.TransportError as error:
                assert "closed" in str(error), error
            else:
                raise AssertionError("a removed set's transport still works")
    assert mapped_segments() == before, (mapped_segments(), before)
    assert glob.glob(SEGMENTS + "*") == [], glob.glob(SEGMENTS + "*")


def test_disagreeing_calls_raise_everywhere():
    if SIZE == 1:
        return
    try:
        kd.add_process_set([RANK])
    except ValueError as error:
        assert "every rank with the same arguments" in str(error), error
        assert "rank 0: (0,)" in str(error) and "rank 1: (1,)" in str(error), error
    else:
        raise AssertionError("ranks adding different sets did not raise")
    assert process_sets.registered() == {0: list(range(SIZE))}


# ---------------------------------------------------------------------------
# comm


def test_sets_from_a_split_communicator():
    parity = RANK % 2
    assert by_comm.ranks == list(range(parity, SIZE, 2))
    assert by_comm.process_set_id == 1 + parity
    assert by_comm.size() == len(by_comm.ranks) and by_comm.rank() == by_comm.ranks.index(RANK)
    assert process_sets.registered() == {0: list(range(SIZE)), 1: list(range(0, SIZE, 2)),
                                         **({2: list(range(1, SIZE, 2))} if SIZE > 1 else {})}
    assert kd.global_process_set.mpi_comm is WORLD
    check_allreduces(by_comm, 2000)


CHECKS = {
    "static": [test_registration, test_allreduce_on_each_parity,
               test_allgather_and_objects_on_each_parity, test_broadcast_on_set_transport,
               test_public_broadcasts_take_job_roots, test_overlapping_sets,
               test_non_members_never_block, test_errors],
    "dynamic": [test_add_get_remove, test_collectives_on_added_sets,
                test_disagreeing_calls_raise_everywhere],
    "comm": [test_sets_from_a_split_communicator],
}
CHECKS["env"] = CHECKS["dynamic"]

run_checks(CHECKS[MODE], rank=RANK, passed="PSETS {name} passed rank={rank}",
           agree=kd.allgather_object)
kd.shutdown()
assert mapped_segments() == [], mapped_segments()
print(f"PSETS shutdown passed rank={RANK}", flush=True)
