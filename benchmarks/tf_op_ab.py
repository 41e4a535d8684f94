"""The traced step's gradient allreduce: keras_dist's op against ``tf.numpy_function``.

    kdrun -np 2 python benchmarks/tf_op_ab.py [--model mlp] [--iters 30] [--steps 10]

One job holds three models of ``keras_dist.bench train``'s kind ``--model``:
keras_dist traced with ``KERAS_DIST_TF_OP=0`` (the ``tf.numpy_function``
op), keras_dist traced with its own op (``KerasDistAllreduce``), and plain
Keras (every rank training alone: the baseline). Blocks of ``--steps``
``train_on_batch`` steps run in turn, the order reversed every other
iteration, each block started by a barrier. Rank 0 prints each kind's median
step (mean over the ranks per block, median over blocks), the efficiency of
each keras_dist kind against the baseline, and, from a timeline recorded
throughout, each rank's wait for peers and time moving data per step.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    import keras_dist as kd
    from keras_dist._runtime import timeline
    from keras_dist.bench.train import build_model, compiled

    kd.init()
    rank = kd.rank()
    rng = np.random.default_rng([7, rank])
    probe = build_model(args.model, 32)
    x = rng.normal(size=(args.batch_size, *probe.input_shape[1:])).astype("float32")
    y = rng.integers(0, probe.output_shape[-1], size=(args.batch_size,))
    del probe

    models = {}
    for kind, setting in (("numpy_function", "0"), ("keras_dist op", "1")):
        os.environ["KERAS_DIST_TF_OP"] = setting  # read when the step is traced
        models[kind] = compiled(args.model, kd.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                                 32)
        for _ in range(5):
            models[kind].train_on_batch(x, y)
    os.environ.pop("KERAS_DIST_TF_OP")
    models["plain"] = compiled(args.model, keras.optimizers.SGD(0.01), 32)
    for _ in range(5):
        models["plain"].train_on_batch(x, y)

    directory = tempfile.mkdtemp(prefix="kd-tf-op-ab-")
    kd.start_timeline(os.path.join(directory, "t.json"))
    order = list(models)
    steps = {kind: [] for kind in order}
    parts = {kind: [0.0, 0.0] for kind in order}  # wait, move seconds
    try:
        for iteration in range(args.iters):
            for kind in order if iteration % 2 == 0 else order[::-1]:
                kd.barrier()
                before = timeline.totals()
                start = time.perf_counter()
                for _ in range(args.steps):
                    models[kind].train_on_batch(x, y)
                steps[kind].append((time.perf_counter() - start) / args.steps * 1e3)
                after = timeline.totals()
                parts[kind][0] += after["wait_s"] - before["wait_s"]
                parts[kind][1] += after["move_s"] - before["move_s"]
    finally:
        kd.stop_timeline(summary=False)
        shutil.rmtree(directory, ignore_errors=True)

    everyone = kd.allgather_object((steps, parts))
    if rank != 0:
        return
    count = args.iters * args.steps
    print(f"{args.model}: {kd.size()} ranks, batch {args.batch_size}, {args.iters} blocks of "
          f"{args.steps} steps per kind, kinds in turn")
    medians = {}
    for kind in order:
        per_block = np.mean([s[kind] for s, _ in everyone], axis=0)
        medians[kind] = float(np.median(per_block))
        print(f"  {kind:15s} median step {medians[kind]:7.3f} ms "
              f"(p25 {np.percentile(per_block, 25):.3f}, p75 {np.percentile(per_block, 75):.3f})")
    for kind in order[:2]:
        waits = " ".join(f"{p[kind][0] / count * 1e3:.3f}" for _, p in everyone)
        moves = " ".join(f"{p[kind][1] / count * 1e3:.3f}" for _, p in everyone)
        print(f"  {kind:15s} efficiency {100 * medians['plain'] / medians[kind]:5.1f}%; "
              f"per step, rank by rank: waiting {waits} ms, moving {moves} ms")


if __name__ == "__main__":
    main()
