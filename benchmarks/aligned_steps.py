"""Does starting the steps together slow the steps? Plain Keras, no keras_dist in the step.

    kdrun -np 2 --bind-to core python benchmarks/aligned_steps.py [--model mlp] [--blocks 40]

Every rank trains its own copy of a ``bench train`` model with plain Keras
(``train_on_batch``, one framework thread). Two kinds of blocks of 20 steps
alternate (each pair's order swapped every other block): ``aligned``, where a
``kd.barrier()`` before every step makes the ranks start each step together,
as a synchronous data-parallel step does, and ``free``, where each rank runs
at its own pace. Only ``train_on_batch`` is timed, never the barrier, so a
difference between the two is what running the same phase of the step at
the same moment costs on this machine (cores sharing caches and memory),
which no allreduce adds and the jitter ceiling of ``bench train`` does not
count. Rank 0 prints each rank's median step (median of per-block medians)
for both kinds and their ratio.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import keras_dist as kd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", help="a bench train model; default mlp")
    parser.add_argument("--blocks", type=int, default=40, help="blocks of each kind; default 40")
    parser.add_argument("--steps", type=int, default=20, help="steps per block; default 20")
    args = parser.parse_args()

    import keras

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    from keras_dist.bench.train import compiled

    kd.init()
    model = compiled(args.model, keras.optimizers.SGD(0.01))
    rng = np.random.default_rng(kd.rank())
    x = rng.standard_normal((32, *model.inputs[0].shape[1:])).astype("float32")
    y = rng.integers(0, 10, 32)
    for _ in range(30):
        model.train_on_batch(x, y)
    medians: dict[str, list[float]] = {"aligned": [], "free": []}
    for block in range(2 * args.blocks):
        mode = ("aligned", "free")[(block + block // 2) % 2]
        kd.barrier()
        times = []
        for _ in range(args.steps):
            if mode == "aligned":
                kd.barrier()
            start = time.perf_counter_ns()
            model.train_on_batch(x, y)
            times.append(time.perf_counter_ns() - start)
        medians[mode].append(float(np.median(times)) / 1e6)
    mine = {mode: float(np.median(values)) for mode, values in medians.items()}
    everyone = kd.allgather_object(mine)
    if kd.rank() == 0:
        print(f"# {keras.backend.backend()}, model {args.model}, {kd.size()} ranks, "
              f"{args.blocks} blocks of {args.steps} steps per kind, medians of block medians")
        for rank, m in enumerate(everyone):
            print(f"rank {rank}: step aligned {m['aligned']:.3f} ms, free {m['free']:.3f} ms, "
                  f"aligned/free {m['aligned'] / m['free']:.3f}", flush=True)
    kd.shutdown()


if __name__ == "__main__":
    main()
