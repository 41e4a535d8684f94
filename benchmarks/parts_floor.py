"""The training path's allreduce beside the memory floor, with caches warm and flushed.

    kdrun -np 2 python benchmarks/parts_floor.py [--model mlp] [--calls 50] [--reps 9]

Every rank makes float32 arrays shaped like the trainable variables of a
``keras_dist.bench train`` model (random, seeded by rank) and times, per
call, three things in alternating blocks:

- ``allreduce_parts``: the shm engine's call that ``DistributedOptimizer``'s
  host call makes inside ``fit`` (Average, sources and destinations separate);
- ``read from a peer``: copying, into private memory, as many bytes as any
  allreduce must bring from other cores (2 (n-1)/n of the message: the
  peers' parts of this rank's share and the peers' reduced shares) out of
  shared memory the next rank has just written: the floor for any algorithm;
- ``local copy``: one copy of the message within the rank's own memory.

Each kind runs twice: ``warm`` (the sources rewritten before each call, as a
backward pass leaves them) and ``flushed`` (each rank also streams through
``--flush-mb`` of its own memory first, as a training step's compute does to
the caches). A call starts after a barrier; a block's figure is the slowest
rank's median call. Rank 0 prints the median over blocks. The last
``allreduce_parts`` results are checked on every rank against the float64
average of every rank's arrays (each rank regenerates the others' from their
seeds).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _arrays(shapes, rank):
    import numpy as np

    rng = np.random.default_rng([4321, rank])
    return [rng.standard_normal(s).astype(np.float32).reshape(-1) for s in shapes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", help="a keras_dist.bench train model")
    parser.add_argument("--calls", type=int, default=50, help="timed calls per block")
    parser.add_argument("--reps", type=int, default=9, help="blocks of each kind")
    parser.add_argument("--flush-mb", type=int, default=64,
                        help="private memory each rank streams through before a flushed call")
    args = parser.parse_args()

    from multiprocessing import resource_tracker, shared_memory

    import numpy as np

    import keras_dist as kd
    from keras_dist import _vocab
    from keras_dist._runtime import context
    from keras_dist.bench import train

    kd.init()
    rank, size = kd.rank(), kd.size()
    engine = context.get().transport.native_engine()
    if size < 2 or engine is None:
        raise SystemExit("parts_floor.py needs 2 or more ranks on the shm transport")
    shapes = [tuple(w.shape) for w in train.build_model(args.model).trainable_weights]
    srcs = _arrays(shapes, rank)
    dsts = [np.empty_like(s) for s in srcs]
    nbytes = sum(s.nbytes for s in srcs)
    peer_bytes = (2 * (size - 1) * nbytes // size) // 4 * 4
    flush = np.ones(args.flush_mb << 18, np.float32)
    private = np.empty(max(nbytes, peer_bytes) // 4, np.float32)
    flat = np.concatenate(srcs)

    # Each rank's region of one segment, written by its owner before each read.
    segment = None
    if rank == 0:
        segment = shared_memory.SharedMemory(create=True, size=size * peer_bytes)
    name = kd.broadcast_object(segment.name if segment else None, root_rank=0)
    if segment is None:
        segment = shared_memory.SharedMemory(name=name)
        # Python < 3.13 registers an attached segment too; rank 0 alone unlinks it.
        resource_tracker.unregister(segment._name, "shared_memory")
    regions: list = []
    try:
        regions += [np.ndarray((peer_bytes // 4,), np.float32, segment.buf, r * peer_bytes)
                   for r in range(size)]
        regions[rank][:] = rank + 1.0
        code = _vocab.dtype_code(np.dtype(np.float32))

        def parts():
            engine.allreduce_parts(srcs, dsts, code, _vocab.SUM, True, "parts_floor")

        def read_peer():
            np.copyto(private[:peer_bytes // 4], regions[(rank + 1) % size])

        def local_copy():
            np.copyto(private[:nbytes // 4], flat)

        kinds = {"allreduce_parts": parts, "read from a peer (floor)": read_peer,
                 "local copy of the message": local_copy}
        results: dict[tuple[str, bool], list[float]] = {}
        for rep in range(args.reps):
            order = [(k, f) for k in kinds for f in (False, True)]
            for kind, flushed in order if rep % 2 == 0 else order[::-1]:
                times = []
                for _ in range(args.calls):
                    for s in srcs:
                        s *= 1.0
                    regions[rank] *= 1.0
                    flat *= 1.0
                    if flushed:
                        flush *= 1.0
                    engine.barrier()
                    start = time.perf_counter()
                    kinds[kind]()
                    times.append(time.perf_counter() - start)
                slowest = max(kd.allgather_object(float(np.median(times))))
                results.setdefault((kind, flushed), []).append(slowest)
        kd.barrier()
    finally:
        regions.clear()  # no view may outlive the mapping
        segment.close()
        if rank == 0:
            segment.unlink()

    everyone = [_arrays(shapes, r) for r in range(size)]
    right = all(np.allclose(got, np.mean([a[i].astype(np.float64) for a in everyone], axis=0),
                            rtol=1e-6, atol=1e-6) for i, got in enumerate(dsts))
    wrong = sum(not ok for ok in kd.allgather_object(right))
    if rank == 0:
        print(f"# {args.model}: {len(shapes)} float32 arrays, {nbytes / 1e6:.2f} MB, {size} ranks;"
              f" from a peer {peer_bytes / 1e6:.2f} MB; median of {args.reps} blocks of "
              f"{args.calls} calls (slowest rank), us")
        print(f"# {'':28} {'warm':>10} {'flushed':>10}")
        med = {key: float(np.median(v)) * 1e6 for key, v in results.items()}
        for kind in kinds:
            print(f"  {kind:28} {med[kind, False]:10.1f} {med[kind, True]:10.1f}")
        floor = "read from a peer (floor)"
        print(f"  {'allreduce_parts / floor':28} "
              f"{med['allreduce_parts', False] / med[floor, False]:10.2f} "
              f"{med['allreduce_parts', True] / med[floor, True]:10.2f}")
        print(f"# #wrong {wrong} (ranks whose allreduce_parts results differ from the float64 "
              "average)", flush=True)
    if wrong:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
