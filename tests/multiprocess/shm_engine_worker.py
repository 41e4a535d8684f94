"""The shm transport checks, on every rank; run by test_shm_engine.py under mpiexec.

    mpiexec -n N python shm_engine_worker.py --job JOB CASE [CASE ...]

Each CASE is one check, a mode and its settings: "MODE [--ranks-per-node K]
[--slot-bytes B] ...". Every rank builds the comms itself, checks ShmTransport
(or, with K > 0, the HierarchicalTransport over pretend machines of K ranks)
against numpy references it computes for all ranks, and reports each case by
name (tests/multiprocess/workers/_checks.py): "CHECK <case> ok rank=R" then
"rank R OK <case>". Case i's segments are named for the job "<JOB>_c<i>", so a
driver can tell which case left one behind. A failed case is reported and the
next one runs; an exception outside the cases aborts the whole job.
"""

from __future__ import annotations

import argparse
import glob
import os
import shlex
import signal
import sys
import threading
import time
import traceback
import warnings

import ml_dtypes
import numpy as np
from mpi4py import MPI

from keras_dist import _vocab as _dtypes
from keras_dist import errors
from keras_dist._config import Config
from keras_dist.transports.hierarchical import HierarchicalTransport
from keras_dist.transports.shm import ShmTransport
from tests.multiprocess.workers._checks import run_checks

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int32, np.int64, np.uint8]
OPS = {
    _dtypes.SUM: np.add,
    _dtypes.MIN: np.minimum,
    _dtypes.MAX: np.maximum,
    _dtypes.PRODUCT: np.multiply,
}
world = MPI.COMM_WORLD
RANK, SIZE = world.Get_rank(), world.Get_size()


def make_transport(args, **settings):
    machine = world.Split_type(MPI.COMM_TYPE_SHARED, key=RANK)
    if args.ranks_per_node:
        local = machine.Split(color=machine.Get_rank() // args.ranks_per_node, key=RANK)
    else:
        local = machine
    config = Config(shm_slot_bytes=args.slot_bytes, job_id=args.job,
                    shm_single_copy=args.single_copy, shm_single_copy_bytes=args.single_copy_bytes,
                    **settings)
    if args.ranks_per_node:
        cross = world.Split(color=local.Get_rank(), key=RANK)
        transport = HierarchicalTransport(world, local, cross, config)
    else:
        transport = ShmTransport(world, config)
    assert transport.rank == RANK and transport.size == SIZE
    if args.expect_single_copy is not None:
        want = args.expect_single_copy and local.Get_size() > 1
        assert transport.single_copy_status.startswith("on" if want else "off"), (
            transport.single_copy_status)
    return transport


def segments(job):
    return glob.glob(f"/dev/shm/kd-{os.getuid()}-{job}-*")


def rank_data(dtype, size, rank, op, seed):
    """Rank `rank`'s random input: never zero, products stay in range."""
    rng = np.random.default_rng([seed, rank])
    dtype = np.dtype(dtype)
    if dtype.kind in "fV" or dtype == np.dtype(ml_dtypes.bfloat16):
        high = 1.5 if op == _dtypes.PRODUCT else 100.0
        mag = rng.uniform(0.5, high, size)
        return np.where(rng.random(size) < 0.5, -mag, mag).astype(dtype)
    info = np.iinfo(dtype)
    values = rng.integers(info.min, info.max, size, dtype=dtype, endpoint=True)
    values[values == 0] = 1
    return values


def reference(inputs, dtype, op):
    dtype = np.dtype(dtype)
    acc_dtype = np.float32 if dtype.itemsize == 2 and dtype.kind != "i" else dtype
    acc = inputs[0].astype(acc_dtype)
    with np.errstate(over="ignore"):
        for x in inputs[1:]:
            acc = OPS[op](acc, x.astype(acc_dtype))
        return acc.astype(dtype)


def check_allreduce(transport, dtype, op, size, seed, exact):
    inputs = [rank_data(dtype, size, r, op, seed) for r in range(SIZE)]
    buf = inputs[RANK].copy()
    transport.allreduce(buf, op)
    label = f"allreduce {np.dtype(dtype).name} {_dtypes.OP_NAMES[op]} size {size}"
    check_against(buf, inputs, dtype, op, exact, label)


def check_against(buf, inputs, dtype, op, exact, label):
    want = reference(inputs, dtype, op)
    # Half-type sums of these inputs are exact in float32 in any order, and
    # every path (hierarchical too) rounds once: bit-exact.
    half_sum = np.dtype(dtype).itemsize == 2 and op == _dtypes.SUM
    if exact or half_sum or np.dtype(dtype).kind in "iu" or op in (_dtypes.MIN, _dtypes.MAX):
        assert np.array_equal(buf.view(np.uint8), want.view(np.uint8)), label
    else:  # hierarchical: another summation order; compare with float64
        got = buf.astype(np.float64)
        ref = want.astype(np.float64)
        scale = np.abs(np.stack([x.astype(np.float64) for x in inputs])).sum(0)
        if op == _dtypes.PRODUCT:
            scale = np.abs(ref)
        tol = 2e-2 if np.dtype(dtype).itemsize == 2 else 1e-5
        assert np.all(np.abs(got - ref) <= tol * scale + 1e-30), label


def mode_correctness(args):
    transport = make_transport(args)
    world.Barrier()
    assert not segments(args.job), "segment name must be unlinked once every rank attached"
    exact = not args.ranks_per_node
    sizes = [0, 1, 7, 64 * SIZE + 3, 20011, 100003]
    for di, dtype in enumerate(DTYPES):
        for op in OPS:
            for size in sizes:
                check_allreduce(transport, dtype, op, size, di * 1000 + op * 100 + size, exact)
    # Broadcast from every root, odd sizes.
    for root in range(SIZE):
        for size in (0, 5, 70001, 1_000_001):
            data = rank_data(np.float32, size, root, _dtypes.SUM, size)
            buf = data.copy() if RANK == root else np.zeros(size, np.float32)
            transport.broadcast(buf, root)
            assert np.array_equal(buf, data), f"broadcast root {root} size {size}"
    # Ragged allgather, including empty contributions.
    for shape in ([3, 0, 1_000_003, 17], [0, 0, 0, 0], [40_000, 1, 2, 3]):
        counts = [shape[r % len(shape)] + r for r in range(SIZE)]
        if sum(counts) == SIZE * (SIZE - 1) // 2 and shape[0] == 0:
            counts = [0] * SIZE
        parts = [rank_data(np.int64, c, r, _dtypes.SUM, 7) for r, c in enumerate(counts)]
        recv = np.empty(sum(counts), np.int64)
        transport.allgatherv(parts[RANK], recv, counts)
        assert np.array_equal(recv, np.concatenate(parts)), f"allgatherv {counts}"
        # In place: this rank's part already sits at its place in `recv`.
        recv = np.full(sum(counts), -1, np.int64)
        at = sum(counts[:RANK])
        recv[at:at + counts[RANK]] = parts[RANK]
        transport.allgatherv(recv[at:at + counts[RANK]], recv, counts)
        assert np.array_equal(recv, np.concatenate(parts)), f"allgatherv in place {counts}"
    # Records: only each rank's used bytes (its first word says how many) are
    # copied; the rest of its place in `recv` is left as it was.
    for capacity in (8, 4192):
        records = np.full((SIZE, capacity), 0xAB, np.uint8)
        used = [8 + (r * 997 + capacity // 3) % (capacity - 7) for r in range(SIZE)]
        used = [min(u, capacity) for u in used]
        mine = rank_data(np.uint8, capacity, RANK, _dtypes.SUM, capacity)
        mine[:8] = np.frombuffer(np.uint64(used[RANK]).tobytes(), np.uint8)
        transport.allgather_records(mine, records.reshape(-1))
        for r in range(SIZE):
            want = rank_data(np.uint8, capacity, r, _dtypes.SUM, capacity)[: used[r]]
            want[:8] = np.frombuffer(np.uint64(used[r]).tobytes(), np.uint8)
            label = f"allgather_records capacity {capacity}, rank {r}'s record"
            assert np.array_equal(records[r, : used[r]], want), label
            if isinstance(transport, ShmTransport):  # others may copy whole records
                assert (records[r, used[r]:] == 0xAB).all(), label + ": bytes past its used ones"
    # Tens of millions of elements: values whose float32 sum is exact in any order.
    big = 12_000_000 + 5
    buf = ((np.arange(big, dtype=np.int64) % 1000) * 0.25 + RANK).astype(np.float32)
    transport.allreduce(buf, _dtypes.SUM)
    want = ((np.arange(big) % 1000) * 0.25 * SIZE + SIZE * (SIZE - 1) / 2).astype(np.float32)
    assert np.array_equal(buf, want), "allreduce 12M float32"
    # Out of place: `send` is read, left as it was, and the sum lands in `buf`.
    for dtype in (np.float32, np.float16):
        for size in (5, 20011, 300_001):
            inputs = [rank_data(dtype, size, r, _dtypes.SUM, size) for r in range(SIZE)]
            send = inputs[RANK].copy()
            out = np.full(size, 7, dtype)
            transport.allreduce(out, _dtypes.SUM, send=send)
            label = f"out-of-place allreduce {np.dtype(dtype).name} size {size}"
            assert np.array_equal(send, inputs[RANK]), label + ": send changed"
            check_against(out, inputs, dtype, _dtypes.SUM, exact, label)
    # Scratch: pack into the shared slot, reduce without a copy in.
    for count in (3, 5000, 100_000):
        scratch = transport.scratch(count * 4).view(np.float32)
        scratch[:] = np.arange(count, dtype=np.float32) * (RANK + 1)
        transport.allreduce(scratch, _dtypes.SUM)
        want = np.arange(count, dtype=np.float32) * (SIZE * (SIZE + 1) // 2)
        assert np.array_equal(scratch, want), f"scratch allreduce {count}"
    transport.barrier()
    transport.close()
    assert not segments(args.job)


def mode_interleaved(args):
    transport = make_transport(args)
    rng = np.random.default_rng(1234)  # same sequence on every rank
    exact = not args.ranks_per_node
    for i in range(300):
        kind = rng.integers(4)
        size = int(rng.choice([0, 1, 3, 100, 5000, 70000]))
        if kind == 0:
            dtype = DTYPES[rng.integers(len(DTYPES))]
            op = int(rng.integers(4))
            check_allreduce(transport, dtype, op, size, i, exact)
        elif kind == 1:
            root = int(rng.integers(SIZE))
            data = rank_data(np.float64, size, root, 0, i)
            buf = data.copy() if RANK == root else np.empty(size)
            transport.broadcast(buf, root)
            assert np.array_equal(buf, data), f"step {i}: broadcast"
        elif kind == 2:
            counts = [int(c) for c in rng.integers(0, size + 1, SIZE)]
            parts = [rank_data(np.int32, c, r, 0, i) for r, c in enumerate(counts)]
            recv = np.empty(sum(counts), np.int32)
            transport.allgatherv(parts[RANK], recv, counts)
            assert np.array_equal(recv, np.concatenate(parts)), f"step {i}: allgatherv"
        else:
            transport.barrier()
    # Many back-to-back small allreduces.
    for i in range(args.repeat):
        count = 1 + i % 16
        buf = np.full(count, RANK + i, np.float32)
        transport.allreduce(buf, _dtypes.SUM)
        assert buf[0] == SIZE * i + SIZE * (SIZE - 1) // 2 and buf[-1] == buf[0], f"small {i}"
    transport.close()
    assert not segments(args.job)


def mode_parts(args):
    """allreduce_parts: every dtype and op (and Average), random part sizes, against
    numpy and bit for bit against allreduce of the fused buffer; mismatches; too large."""
    transport = make_transport(args)
    rng = np.random.default_rng(77)  # the same part sizes on every rank
    for di, dtype in enumerate(DTYPES):
        for op in OPS:
            for average in (False, True) if op == _dtypes.SUM else (False,):
                # The last is larger than one shared buffer (2 MiB) for every dtype
                # of 2 bytes or more: it goes in windows (uint8's, 1.3 MB, in one round).
                for sizes in ([1], [7, 0, 64 * SIZE + 3], list(rng.integers(0, 3000, 6)),
                              [20011, 1, 100003], [300_001, 3, 1_000_007]):
                    seed = di * 1000 + op * 100 + len(sizes) + 7 * average
                    total = int(sum(sizes))
                    inputs = [rank_data(dtype, total, r, op, seed) for r in range(SIZE)]
                    bounds = np.cumsum([0, *sizes])
                    srcs = [inputs[RANK][a:b].copy() for a, b in zip(bounds, bounds[1:])]
                    before = [x.copy() for x in srcs]
                    dsts = [np.full_like(x, 3) for x in srcs]
                    transport.allreduce_parts(srcs, dsts, op, average)
                    label = (f"allreduce_parts {np.dtype(dtype).name} "
                             f"{_dtypes.OP_NAMES[op]} average={average} sizes {sizes}")
                    assert all(np.array_equal(x, y) for x, y in zip(srcs, before)), label
                    got = np.concatenate(dsts)
                    fused = inputs[RANK].copy()
                    transport.allreduce(fused, op)
                    if average:  # as the tensor layer finishes an Average
                        _dtypes.finish_reduction(fused, _dtypes.ReduceOp.AVERAGE, SIZE, 1.0)
                    else:
                        check_against(got, inputs, dtype, op, not args.ranks_per_node, label)
                    assert np.array_equal(got.view(np.uint8), fused.view(np.uint8)), label
                    if average and np.dtype(dtype).kind == "f":
                        want = np.stack([x.astype(np.float64) for x in inputs]).mean(0)
                        scale = np.abs(np.stack([x.astype(np.float64) for x in inputs])).sum(0)
                        tol = 2e-3 if np.dtype(dtype).itemsize == 2 else 1e-6
                        assert np.all(np.abs(got.astype(np.float64) - want)
                                      <= tol * scale), label
    # Parts of any shape (read as they are), a 0-d array and a numpy scalar among them.
    inputs = [rank_data(np.float32, 3 * 5 + 1 + 1 + 8, r, _dtypes.SUM, 4321) for r in range(SIZE)]
    mine = inputs[RANK]
    srcs = [mine[:15].reshape(3, 5), mine[15:16].reshape(()), mine[16], mine[17:].reshape(2, 2, 2)]
    dsts = [np.empty((3, 5), np.float32), np.empty((), np.float32), np.empty(1, np.float32),
            np.empty((2, 2, 2), np.float32)]
    transport.allreduce_parts(srcs, dsts, _dtypes.SUM)
    got = np.concatenate([d.reshape(-1) for d in dsts])
    check_against(got, inputs, np.float32, _dtypes.SUM, not args.ranks_per_node,
                  "allreduce_parts of shaped parts")
    # In place: each destination its own source.
    xs = [np.full(5, RANK + 1.0, np.float32), np.full(70_001, RANK + 2.0, np.float32)]
    transport.allreduce_parts(xs, xs, _dtypes.SUM)
    assert np.all(xs[0] == SIZE * (SIZE + 1) / 2) and np.all(xs[1] == SIZE * (SIZE + 3) / 2)
    # Four times the slot, in place: in windows.
    big = rank_data(np.float32, args.slot_bytes, RANK, _dtypes.SUM, 99)
    transport.allreduce_parts([big], [big], _dtypes.SUM)
    check_against(big, [rank_data(np.float32, args.slot_bytes, r, _dtypes.SUM, 99)
                        for r in range(SIZE)], np.float32, _dtypes.SUM,
                  not args.ranks_per_node, "allreduce_parts in place, in windows")
    cases = [
        (lambda: transport.allreduce_parts([np.ones(10 + RANK, np.float32)],
                                           [np.empty(10 + RANK, np.float32)], _dtypes.SUM),
         "count"),
        # Rank 0's message in windows, the others' in one round.
        (lambda: transport.allreduce_parts([np.ones(300_000 << (RANK == 0), np.float32)],
                                           [np.empty(300_000 << (RANK == 0), np.float32)],
                                           _dtypes.SUM), "count"),
        (lambda: transport.allreduce_parts([np.ones(8, DTYPES[2 + RANK % 2])],
                                           [np.empty(8, DTYPES[2 + RANK % 2])], _dtypes.SUM),
         "dtype"),
        (lambda: transport.allreduce_parts([np.ones(8, np.float32)], [np.empty(8, np.float32)],
                                           _dtypes.SUM, name=f"g{RANK}"), "name"),
        # One rank fuses into its own buffer, the others pass parts.
        (lambda: transport.allreduce(np.ones(8, np.float32), _dtypes.SUM) if RANK == 0 else
         transport.allreduce_parts([np.ones(8, np.float32)], [np.empty(8, np.float32)],
                                   _dtypes.SUM), "take different paths"),
    ]
    for call, word in cases if SIZE > 1 else []:  # one rank cannot disagree
        try:
            call()
        except errors.CollectiveMismatchError as exc:
            message = str(exc)
            assert word in message and "rank 0" in message and "rank 1" in message, message
            if word == "take different paths":
                assert "from parts" in message, message
        else:
            raise AssertionError(f"allreduce_parts: no mismatch error for differing {word}")
        xs = [np.ones(3, np.float32), np.ones(4, np.float32)]
        transport.allreduce_parts(xs, xs, _dtypes.SUM)
        assert all(np.all(x == SIZE) for x in xs), "usable after a mismatch"
    try:
        transport.allreduce_parts([np.ones(4, np.float32)], [np.empty(3, np.float32)],
                                  _dtypes.SUM)
    except ValueError as exc:
        assert "dsts[0]" in str(exc) and "Received" in str(exc), exc
    else:
        raise AssertionError("allreduce_parts took destinations of another size")
    transport.close()


def mode_mismatch(args):
    transport = make_transport(args)
    def own_or_scratch(count):
        # Rank 0 reduces its scratch() buffer, the others a buffer of their own.
        if RANK == 0:
            return transport.scratch(count * 4).view(np.float32)
        return np.empty(count, np.float32)

    cases = [
        (lambda: transport.allreduce(np.ones(10 + RANK, np.float32), _dtypes.SUM), "count"),
        (
            lambda: transport.allreduce(np.ones(8, DTYPES[2 + RANK % 2]), _dtypes.SUM),
            "dtype",
        ),
        (lambda: transport.allreduce(np.ones(8, np.float32), RANK % 2), "op"),
        (lambda: transport.allreduce(np.ones(8, np.float32), 0, name=f"g{RANK}"), "name"),
        (lambda: transport.broadcast(np.ones(4, np.float32), RANK % 2), "root"),
        (
            lambda: transport.allreduce(np.ones(4, np.float32), 0)
            if RANK % 2
            else transport.barrier(),
            "called",
        ),
        (lambda: transport.allreduce(own_or_scratch(8), _dtypes.SUM), "take different paths"),
        (lambda: transport.allreduce(own_or_scratch(100_000), _dtypes.SUM),
         "take different paths"),
    ]
    for call, word in cases:
        try:
            call()
        except errors.CollectiveMismatchError as exc:
            message = str(exc)
            assert word in message and "rank 0" in message and "rank 1" in message, message
            if word == "count":
                assert "rank 0 has dtype float32 count 10" in message, message
            if word == "name":
                assert "name 'g0'" in message and "name 'g1'" in message, message
            if word == "take different paths":
                assert "rank 0 in shared memory" in message and "scratch()" in message, message
        else:
            raise AssertionError(f"no mismatch error for differing {word}")
        # The engine stays usable after a mismatch.
        buf = np.ones(5, np.float32)
        transport.allreduce(buf, _dtypes.SUM)
        assert np.all(buf == SIZE)
    transport.close()


def check_still_exact(transport, label):
    for size in (3, 1_000_003):
        check_allreduce(transport, np.float32, _dtypes.SUM, size, size, True)
        counts = [size + r for r in range(SIZE)]
        parts = [rank_data(np.int64, c, r, _dtypes.SUM, 9) for r, c in enumerate(counts)]
        recv = np.empty(sum(counts), np.int64)
        transport.allgatherv(parts[RANK], recv, counts)
        assert np.array_equal(recv, np.concatenate(parts)), f"{label}: allgatherv {counts}"


def mode_fallback_disabled(args):
    """Single copy turned off on one rank only: every rank takes the copy path."""
    args.single_copy = "off" if RANK == SIZE - 1 else "auto"
    transport = make_transport(args)
    status = transport.single_copy_status
    assert status == f"off: disabled on rank {SIZE - 1}", status
    check_still_exact(transport, "disabled on one rank")
    transport.close()


def mode_fallback_unreadable(args):
    """Rank 0 is given another process's pid for rank 1: its probe read fails
    (or finds the wrong value), and every rank takes the copy path."""
    import subprocess

    from keras_dist import _native
    from keras_dist.transports.shm import segment_name

    assert SIZE == 2
    stranger = subprocess.Popen(["sleep", "120"]) if RANK == 0 else None
    try:
        pids = world.allgather(os.getpid())
        if RANK == 0:
            pids[1] = stranger.pid  # alive, so liveness checks pass; not rank 1
        name = world.bcast(segment_name(args.job) if RANK == 0 else None, root=0)
        engine = None
        if RANK == 0:
            engine = _native.ShmEngine(name, True, 0, 2, 1 << 20, pids)
        world.Barrier()
        if RANK == 1:
            engine = _native.ShmEngine(name, False, 1, 2, 1 << 20, pids)
        engine.attach()
        assert not engine.single_copy, engine.single_copy_status
        status = engine.single_copy_status
        assert status.startswith("off: local rank 0 cannot read the memory of local rank 1") or (
            "names another process" in status), status
        for count in (3, 2_000_003):
            buf = np.full(count, RANK + 1.0, np.float32)
            engine.allreduce(buf, _dtypes.FLOAT32, _dtypes.SUM)
            assert np.all(buf == 3.0), f"allreduce {count} after a failed probe"
        engine.unlink()
        del engine
    finally:
        if stranger is not None:
            stranger.kill()
            stranger.wait()


def mode_mismatch_machines(args):
    """Machines that disagree: every rank raises, naming the machines' leaders."""
    transport = make_transport(args)
    machine = RANK // args.ranks_per_node
    try:
        transport.allreduce(np.ones(10 + machine, np.float32), _dtypes.SUM, name="grads")
    except errors.CollectiveMismatchError as exc:
        message = str(exc)
        assert "allreduce mismatch between machines" in message, message
        assert "rank 0 has" in message and "count 10" in message and "count 11" in message, message
    else:
        raise AssertionError("no mismatch error between machines")
    transport.close()


def mode_stall(args):
    transport = make_transport(args, stall_check_seconds=0.3, timeout_seconds=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if RANK == 1:
            time.sleep(1.2)
        buf = np.ones(3, np.float32)
        transport.allreduce(buf, _dtypes.SUM)
    assert np.all(buf == SIZE)
    if RANK == 0:
        stalls = [w for w in caught if issubclass(w.category, errors.StallWarning)]
        assert stalls and "rank 1" in str(stalls[0].message), [str(w.message) for w in caught]
    transport.close()


def mode_timeout(args):
    transport = make_transport(args, timeout_seconds=0.5)
    if RANK == 0:
        try:
            transport.allreduce(np.ones(3, np.float32), _dtypes.SUM)
        except errors.CollectiveTimeoutError as exc:
            assert "rank 1" in str(exc) and "timed out after 0.5 s" in str(exc), str(exc)
        else:
            raise AssertionError("no timeout")
        world.Barrier()
    else:
        world.Barrier()  # rank 0 has given up: this rank now learns it aborted
        try:
            transport.allreduce(np.ones(3, np.float32), _dtypes.SUM)
        except errors.PeerFailureError as exc:
            assert "rank 0" in str(exc), str(exc)
        else:
            raise AssertionError("no peer failure after rank 0 aborted")
    transport.close()


def mode_interrupt(args):
    """SIGINT while waiting for a peer raises KeyboardInterrupt; the peer learns of it."""
    transport = make_transport(args)
    if RANK == 0:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            transport.allreduce(np.ones(3, np.float32), _dtypes.SUM)
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("no KeyboardInterrupt")
        world.Barrier()
    else:
        world.Barrier()
        try:
            transport.allreduce(np.ones(3, np.float32), _dtypes.SUM)
        except errors.PeerFailureError as exc:
            assert "rank 0" in str(exc) and "interrupted" in str(exc), str(exc)
        else:
            raise AssertionError("no peer failure after rank 0 was interrupted")
    transport.close()


def mode_death(args):
    """Rank 1 dies without a word; the others must raise within seconds."""
    transport = make_transport(args)
    if RANK == 1:
        os._exit(3)
    try:
        transport.allreduce(np.ones(args.death_count, np.float32), _dtypes.SUM)
    except errors.PeerFailureError as exc:
        assert "rank 1" in str(exc) and "died" in str(exc), str(exc)
    else:
        raise AssertionError("no peer failure")
    print(f"rank {RANK} OK {args.mode}", flush=True)
    os._exit(0)


def case_parser():
    parser = argparse.ArgumentParser(prog="CASE")
    parser.add_argument("mode")
    parser.add_argument("--ranks-per-node", type=int, default=0)
    parser.add_argument("--slot-bytes", type=int, default=16 << 20)
    parser.add_argument("--repeat", type=int, default=10_000)
    parser.add_argument("--single-copy", choices=("auto", "off"), default="auto")
    parser.add_argument("--single-copy-bytes", type=int, default=1 << 20)
    parser.add_argument("--death-count", type=int, default=3)
    parser.add_argument("--expect-single-copy", type=int, choices=(0, 1), default=None)
    return parser


def case_check(case, job):
    """The check that runs `case` ("MODE --option value ...") on segments of `job`."""
    args = case_parser().parse_args(shlex.split(case))
    args.job = job
    mode = globals()[f"mode_{args.mode}"]

    def check():
        mode(args)

    check.__name__ = case
    return check


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", default="")
    parser.add_argument("cases", nargs="+", help='each "MODE [--option value ...]"')
    options = parser.parse_args()
    job = world.bcast(options.job or f"t{os.getpid()}", root=0)
    checks = [case_check(case, f"{job}_c{index}") for index, case in enumerate(options.cases)]
    run_checks(checks, rank=RANK, passed="rank {rank} OK {name}", agree=world.allgather)


if __name__ == "__main__":
    try:
        main()
    except SystemExit:  # run_checks: a case failed, reported by name on every rank
        raise
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        world.Abort(1)
