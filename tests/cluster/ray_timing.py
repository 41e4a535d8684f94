"""How long ``RayExecutor`` takes to start, to shut down, and to raise once a
worker dies, on the local multi-node Ray cluster of tests/cluster/test_ray.py
(a head node without CPUs, two worker nodes), for the numbers in docs/ray.md.

    python tests/cluster/ray_timing.py [--workers 2 4] [--repeats 3]

Each start places the workers (PACK), starts their actors and forms the job;
nothing imports a framework there (the first ``run`` that imports Keras pays
that). "killed -> raised" is the time ``run()`` takes to raise
``PeerFailureError`` when the function kills rank 1 at once (rank 0 waits in
an allreduce), including handing the function to the workers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from keras_dist.errors import PeerFailureError  # noqa: E402
from keras_dist.ray import RayExecutor  # noqa: E402
from tests.cluster import ray_workers  # noqa: E402
from tests.cluster.ray_cluster import WORKER_ENV, start_local_cluster  # noqa: E402


def _seconds(values: list[float]) -> str:
    return f"{statistics.median(values):>7.2f} ({min(values):.2f}-{max(values):.2f})"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpus-per-node", type=int, default=2)
    args = parser.parse_args(argv)
    cluster = start_local_cluster(worker_nodes=2, cpus_per_node=args.cpus_per_node)
    try:
        ray.init(address=cluster.address, runtime_env={"env_vars": WORKER_ENV},
                 log_to_driver=False)
        print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; Ray "
              f"{ray.__version__}; 2 worker nodes of {args.cpus_per_node} CPUs; "
              f"median (min-max) of {args.repeats}, seconds")
        print(f"{'workers':>7} {'start()':>18} {'shutdown()':>18} {'killed -> raised':>18}")
        for workers in args.workers:
            starts, stops, failures = [], [], []
            for _ in range(args.repeats):
                executor = RayExecutor(num_workers=workers)
                began = time.perf_counter()
                executor.start()
                starts.append(time.perf_counter() - began)
                assert len(executor.run(os.getpid)) == workers
                began = time.perf_counter()
                executor.shutdown()
                stops.append(time.perf_counter() - began)
                executor = RayExecutor(num_workers=workers)
                executor.start()
                began = time.perf_counter()
                try:
                    executor.run(ray_workers.die_on_rank, args=(1,))
                except PeerFailureError as error:
                    assert error.peer_rank == 1, error
                failures.append(time.perf_counter() - began)
                executor.shutdown()
            print(f"{workers:>7} {_seconds(starts):>18} {_seconds(stops):>18} "
                  f"{_seconds(failures):>18}", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
