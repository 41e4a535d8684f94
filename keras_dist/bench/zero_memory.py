"""Memory and step time of sharded optimizer state against the unsharded optimizer.

Run on every rank under kdrun, once per mode (peak resident memory is a
process's own, so each mode gets fresh processes)::

    kdrun -np 2 python -m keras_dist.bench.zero_memory --params 100e6 --mode unsharded
    kdrun -np 2 python -m keras_dist.bench.zero_memory --params 100e6 --mode sharded

Trains a stack of square Dense layers of about ``--params`` parameters with
Adam on random data (Keras ``train_on_batch``, the backend of KERAS_BACKEND)
and prints, per rank, one line ``ZERO {json}``: the bytes of optimizer
state the rank holds, its peak resident memory (``ru_maxrss``), and the
median step time after the first (compiling) step.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time


def _state_bytes(optimizer) -> int:
    import numpy as np

    inner = optimizer.inner_optimizer
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in inner.variables)


def run(params: float, mode: str, steps: int, width: int, batch: int) -> dict:
    import keras
    import numpy as np

    import keras_dist as kd

    kd.init()
    layers = max(1, round(params / (width * width + width)))
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((width,))]
                             + [keras.layers.Dense(width) for _ in range(layers)])
    optimizer = kd.DistributedOptimizer(keras.optimizers.Adam(1e-4),
                                        shard_optimizer_state=mode == "sharded")
    model.compile(optimizer=optimizer, loss="mse")
    rng = np.random.default_rng(kd.rank())
    x = rng.normal(size=(batch, width)).astype("float32")
    y = rng.normal(size=(batch, width)).astype("float32")
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        model.train_on_batch(x, y)
        times.append(time.perf_counter() - start)
    return {"rank": kd.rank(), "size": kd.size(), "mode": mode,
            "backend": keras.backend.backend(), "parameters": model.count_params(),
            "optimizer_state_bytes": _state_bytes(optimizer),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "median_step_s": statistics.median(times[1:]) if steps else None}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--mode", choices=["sharded", "unsharded"], required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    result = run(args.params, args.mode, args.steps, args.width, args.batch)
    print("ZERO " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
