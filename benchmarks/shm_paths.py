"""The shm engine's two data paths for large messages, side by side in one job.

    kdrun -np 2 python benchmarks/shm_paths.py [allreduce|allgather] [--reps 7]

Two shm transports live in the same job: one copies through the shared slots
(``KERAS_DIST_SHM_SINGLE_COPY=off``), the other reads peers' buffers with
``process_vm_readv`` at every size (threshold 1 byte). Their blocks of calls
alternate, each block's time is the slowest rank's, and rank 0 prints the
median per call of each and their ratio. Every result is checked. This is
how the engine's thresholds (1 MiB for allreduce, 16 KiB for allgather) were
chosen. Broadcast always copies through the slots: the root's copy in overlaps
the readers' copies out, and reading the root's buffer directly measured no
faster (0.8-1.07x from 16 KiB to 4 MiB, 1.45x slower at 16 MiB).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from keras_dist import _vocab as _dtypes
from keras_dist._config import Config
from keras_dist.transports.shm import ShmTransport


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("collective", nargs="?", default="allreduce",
                        choices=("allreduce", "allgather"))
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--min-bytes", type=int, default=4096)
    parser.add_argument("--max-bytes", type=int, default=64 << 20)
    args = parser.parse_args()

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    job = world.bcast(f"paths{time.time_ns() % 10**8}", root=0)
    paths = {
        "copy": ShmTransport(local, Config(job_id=job, shm_single_copy="off")),
        "single": ShmTransport(local, Config(job_id=job, shm_single_copy_bytes=1)),
    }
    status = paths["single"].single_copy_status
    if rank == 0:
        print(f"# {args.collective}, {size} ranks, float32; single-copy reads: {status}")
        print(f"# median of {args.reps} alternating blocks, slowest rank per block")
        print(f"# {'bytes':>10} {'copy (us)':>12} {'single (us)':>12} {'single/copy':>12}")

    nbytes = args.min_bytes
    while nbytes <= args.max_bytes:
        count = nbytes // 4
        rng = np.random.default_rng([rank, count])
        mine = rng.standard_normal(count).astype(np.float32)
        buf = np.empty(count, np.float32)
        recv = np.empty(count * size, np.float32)

        def call(transport, buf=buf, mine=mine, recv=recv, counts=[count] * size):
            if args.collective == "allreduce":
                transport.allreduce(buf, _dtypes.SUM, send=mine)
            else:
                transport.allgatherv(mine, recv, counts)

        iters = max(3, min(1000, (1 << 28) // max(nbytes, 1) // 8))
        seconds = {name: [] for name in paths}
        for _ in range(args.reps):
            for name, transport in paths.items():
                call(transport)
                world.Barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    call(transport)
                elapsed = world.allreduce((time.perf_counter() - start) / iters, op=MPI.MAX)
                seconds[name].append(elapsed)
        # Check the last result of each path against a float64 reference.
        everyone = world.allgather(mine)
        for name, transport in paths.items():
            call(transport)
            if args.collective == "allreduce":
                want = np.sum(np.stack(everyone).astype(np.float64), axis=0)
                ok = np.allclose(buf, want, rtol=1e-5, atol=1e-5 * size)
            else:
                ok = np.array_equal(recv, np.concatenate(everyone))
            if not all(world.allgather(ok)):
                raise SystemExit(f"{name} path gave a wrong {args.collective} at {nbytes} bytes")
        if rank == 0:
            copy, single = (np.median(seconds[k]) * 1e6 for k in ("copy", "single"))
            print(f"  {nbytes:>10} {copy:>12.1f} {single:>12.1f} {single / copy:>12.2f}",
                  flush=True)
        nbytes *= 4
    for transport in paths.values():
        transport.close()


if __name__ == "__main__":
    main()
