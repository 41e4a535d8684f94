"""Mismatched collectives, each followed by correct ones: the group stays usable.

Usage: recovery.py CASE [CASE ...], each CASE "TRANSPORT [RANKS_PER_NODE]": one
``init`` (``KERAS_DIST_CPU_OPERATIONS=TRANSPORT``, ``KERAS_DIST_RANKS_PER_NODE``)
and ``shutdown`` per case, each case reported by name
(tests/multiprocess/workers/_checks.py). For every scenario, and for every choice of which ranks
call the other variant (the last rank, rank 1, every rank but 0: inside one
machine or between machines on the hierarchical transport), every rank must
raise ``CollectiveMismatchError`` with the same message, and then a round of
collectives (every kind, several dtypes) must give the float64 numpy result
on every rank. Prints "RECOVERY OK case=C rank=R size=N transport=T scenarios=K" per case.
"""

from __future__ import annotations

import os
import sys

import numpy as np
from mpi4py import MPI

import keras_dist as kd
from tests.multiprocess.workers._checks import run_checks

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def data(rank: int, salt: int, count: int, dtype) -> np.ndarray:
    """Rank ``rank``'s random values (never zero), the same on every rank."""
    rng = np.random.default_rng([rank, salt])
    if np.dtype(dtype).kind == "f":
        return (rng.uniform(0.5, 2.0, count) * rng.choice([-1, 1], count)).astype(dtype)
    if np.dtype(dtype).kind == "b":
        return rng.random(count) < 0.5
    info = np.iinfo(dtype)
    low, high = max(info.min, -50), min(info.max, 50)
    values = rng.integers(low, high, count, endpoint=True).astype(dtype)
    values[values == 0] = 1
    return values


def check_round(salt: int) -> None:
    """Every collective, checked against float64 numpy on every rank."""
    # allreduce: float32 average, int8 max and wrapping sum, uint16/int16 sum, float64 product.
    x = data(RANK, salt, 37, np.float32)
    want = np.mean([data(r, salt, 37, np.float64) for r in range(SIZE)], axis=0)
    np.testing.assert_allclose(kd.allreduce(x), want, rtol=1e-5, atol=1e-5)  # float32 sums
    for dtype, op, ref in [(np.int8, kd.Max, np.max), (np.int16, kd.Sum, np.sum),
                           (np.uint16, kd.Min, np.min), (np.float64, kd.Product, np.prod)]:
        x = data(RANK, salt + 1, 29, dtype)
        want = ref([data(r, salt + 1, 29, dtype).astype(np.float64) for r in range(SIZE)], axis=0)
        got = kd.allreduce(x, op=op)
        assert got.dtype == np.dtype(dtype), (got.dtype, dtype)
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-12)
    # broadcast from the last rank, bool and float32.
    root = SIZE - 1
    for dtype in (np.bool_, np.float32):
        got = kd.broadcast(data(RANK, salt + 2, 19, dtype), root_rank=root)
        np.testing.assert_array_equal(got, data(root, salt + 2, 19, dtype))
    # allgather of different first dimensions.
    parts = [data(r, salt + 3, (r + 1) * 6, np.int16).reshape(r + 1, 6) for r in range(SIZE)]
    np.testing.assert_array_equal(kd.allgather(parts[RANK]), np.concatenate(parts))
    kd.barrier()


def mismatches(odd: bool) -> dict:
    """One call per scenario; ``odd`` ranks call the other variant."""
    x = data(RANK, 99, 12, np.float32)
    return {
        "allreduce_dtype": lambda: kd.allreduce(x.astype(np.float64) if odd else x),
        "allreduce_count": lambda: kd.allreduce(x[:10] if odd else x),
        "allreduce_op": lambda: kd.allreduce(x, op=kd.Max if odd else kd.Sum),
        "allreduce_int_dtype": lambda: kd.allreduce(
            x.astype(np.int8) if odd else x.astype(np.int16), op=kd.Sum),
        "broadcast_root": lambda: kd.broadcast(x, root_rank=1 if odd else 0),
        "broadcast_bytes": lambda: kd.broadcast(x[:10] if odd else x, root_rank=0),
        "allgather_shape": lambda: kd.allgather(x.reshape(2, 6) if odd else x.reshape(3, 4)),
        "allgather_dtype": lambda: kd.allgather(x.astype(np.int32) if odd else x),
        "barrier_vs_allreduce": lambda: kd.barrier() if odd else kd.allreduce(x),
        "allreduce_vs_broadcast": lambda: (kd.broadcast(x, root_rank=0) if odd
                                           else kd.allreduce(x)),
    }


def odd_sets() -> list[frozenset]:
    """Which ranks call the other variant: the last, rank 1, all but rank 0."""
    sets = [frozenset({SIZE - 1}), frozenset({1}), frozenset(range(1, SIZE))]
    return list(dict.fromkeys(sets))


def check_every_scenario(label: str) -> None:
    """Case ``label`` ("TRANSPORT [RANKS_PER_NODE]"): every scenario, each followed
    by a round of correct collectives, under its own ``init``."""
    transport, *ranks_per_node = label.split()
    os.environ["KERAS_DIST_CPU_OPERATIONS"] = transport
    if ranks_per_node:
        os.environ["KERAS_DIST_RANKS_PER_NODE"] = ranks_per_node[0]
    else:
        os.environ.pop("KERAS_DIST_RANKS_PER_NODE", None)
    kd.init()
    try:
        assert (kd.rank(), kd.size()) == (RANK, SIZE), (kd.rank(), kd.size())
        name = kd._get().transport.name
        scenarios = 0
        check_round(0)
        for odd_ranks in odd_sets():
            for scenario, call in mismatches(RANK in odd_ranks).items():
                try:
                    call()
                except kd.CollectiveMismatchError as error:
                    message = str(error)
                else:
                    raise AssertionError(
                        f"{scenario} (odd ranks {sorted(odd_ranks)}) did not raise")
                everyone = kd.allgather_object(message)
                assert all(m == message for m in everyone), (scenario, everyone)
                check_round(scenarios + 1)
                scenarios += 1
    finally:
        kd.shutdown()
    print(f"RECOVERY OK case={label} rank={RANK} size={SIZE} transport={name} "
          f"scenarios={scenarios}", flush=True)


def case_check(label: str):
    def check_case():
        check_every_scenario(label)

    check_case.__name__ = label
    return check_case


run_checks([case_check(label) for label in sys.argv[1:]], rank=RANK,
           agree=MPI.COMM_WORLD.allgather)
