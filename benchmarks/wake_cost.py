"""What a sleeping waiter costs: the shm engine's two wait policies side by side in one job.

    kdrun -np 2 python benchmarks/wake_cost.py [--reps 7] [--calls 200]

The ranks take turns arriving late at a 4-byte ``kd.allreduce``: in call i,
rank ``i % size`` computes (a busy loop) for ``lateness`` first while the
others wait. With one core per rank the time an iteration takes beyond the
lateness is the collective plus whatever the waiters' way of waiting adds to
the late rank: a waiter that went to sleep in the futex must be woken and
scheduled before the collective can finish. Two policies alternate in blocks:
the waiters yield for ``yield_seconds`` (100 us) and then sleep, or for
``own_core_yield_seconds`` (20 ms, the engine's choice when every local rank
has a CPU of its own). Rank 0 prints the median over blocks of the overhead
per iteration (the slowest rank's block time / calls - lateness).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from keras_dist._native import WAIT_TIMINGS

import keras_dist as kd
from keras_dist._runtime import context
from keras_dist.tensor import ops


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7, help="blocks per policy and lateness")
    parser.add_argument("--calls", type=int, default=200, help="collectives per block")
    args = parser.parse_args()
    kd.init()
    rank, size = kd.rank(), kd.size()
    transport = ops._one_call_transport(context.get())
    if transport is None or transport.engine is None:
        raise SystemExit("wake_cost.py needs the shm transport (every rank on one machine)")
    engine = transport.engine
    policies = {"sleep after 100 us": WAIT_TIMINGS["yield_seconds"],
                "poll for 20 ms": WAIT_TIMINGS["own_core_yield_seconds"]}
    x = np.ones(1, np.float32)
    if rank == 0:
        print(f"# {size} ranks; engine's own policy here: yield_seconds = "
              f"{engine.yield_seconds * 1e3:g} ms")
        print("# overhead per iteration beyond the lateness, us (median of "
              f"{args.reps} blocks of {args.calls} calls, slowest rank)")
        print(f"# {'lateness (ms)':>13} " + " ".join(f"{p:>20}" for p in policies) + "   ratio")
    own = engine.yield_seconds
    try:
        for lateness in (0.2e-3, 1e-3, 3e-3, 8e-3):
            blocks = {p: [] for p in policies}
            for _ in range(args.reps):
                for policy, seconds in policies.items():
                    engine.yield_seconds = seconds
                    kd.barrier()
                    start = time.perf_counter()
                    for i in range(args.calls):
                        if i % size == rank:
                            _busy(lateness)
                        out = kd.allreduce(x, op=kd.Sum, name="wake")
                    elapsed = time.perf_counter() - start
                    if out[0] != size:
                        raise SystemExit(f"rank {rank}: allreduce gave {out[0]}, not {size}")
                    slowest = max(kd.allgather_object(elapsed))
                    blocks[policy].append(slowest / args.calls - lateness)
            if rank == 0:
                medians = [float(np.median(blocks[p])) * 1e6 for p in policies]
                print(f"  {lateness * 1e3:13.1f} " + " ".join(f"{m:20.1f}" for m in medians)
                      + f"   {medians[1] / medians[0]:5.2f}", flush=True)
    finally:
        engine.yield_seconds = own


if __name__ == "__main__":
    main()
