"""A traced training step's gradients out of the host call: one buffer against one output each.

    kdrun -np 2 python benchmarks/host_call_outputs.py [--model cnn] [--steps 60] [--reps 21]

Inside a ``tf.function`` the gradients' allreduce is one ``tf.numpy_function``
op, and TensorFlow spends about 10 us per output of that op. Since
2026-12-04 the gradients up to 64 KiB leave it as one buffer that the graph
slices apart (``conversions._buffer_layout``), larger ones on their own.

Every rank trains three copies of the same ``keras_dist.bench train`` model
(``train_on_batch``, SGD, batch 32, one TensorFlow thread), in alternating
blocks after a barrier and 3 untimed steps: plain Keras (``plain``),
``DistributedOptimizer`` traced with every gradient an output of its own
(``separate``: the layout switched off while it traces), and
``DistributedOptimizer`` as shipped (``one buffer``). Rank 0 prints each
rank's median step (over blocks) of each and the difference. Both
keras_dist models must end with the same weights on every rank (checked,
float64 sums of every variable; a mismatch exits 1).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="cnn", help="a keras_dist.bench train model")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per block")
    parser.add_argument("--reps", type=int, default=21, help="blocks of each kind")
    args = parser.parse_args()

    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    import keras_dist as kd
    from keras_dist.bench import train
    from keras_dist.tensor import conversions

    kd.init()
    rank, size = kd.rank(), kd.size()
    rng = np.random.default_rng([1234, rank])
    x = rng.normal(size=(args.batch_size, *train.build_model(args.model).input_shape[1:]))
    x = x.astype("float32")
    y = rng.integers(0, 10, size=(args.batch_size,))

    def distributed():
        return train._compiled(args.model, kd.DistributedOptimizer(keras.optimizers.SGD(0.01)))

    models = {"plain": train._compiled(args.model, keras.optimizers.SGD(0.01)),
              "separate": distributed(), "one buffer": distributed()}
    layout = conversions._buffer_layout
    conversions._buffer_layout = lambda dtypes, shapes: None  # traced now: one output each
    models["separate"].train_on_batch(x, y)
    conversions._buffer_layout = layout
    models["one buffer"].train_on_batch(x, y)
    kinds = list(models)
    blocks = {k: [] for k in kinds}
    for rep in range(args.reps):
        for kind in kinds if rep % 2 == 0 else kinds[::-1]:
            model = models[kind]
            kd.barrier()
            for _ in range(3):
                model.train_on_batch(x, y)
            start = time.perf_counter()
            for _ in range(args.steps):
                model.train_on_batch(x, y)
            blocks[kind].append((time.perf_counter() - start) / args.steps)
    medians = {k: 1e3 * float(np.median(v)) for k, v in blocks.items()}
    sums = [[float(np.sum(np.asarray(w, np.float64))) for w in models[k].get_weights()]
            for k in ("separate", "one buffer")]
    everyone = kd.allgather_object((medians, sums))
    wrong = sum(s != everyone[0][1] for _, s in everyone)
    if rank == 0:
        tensors = len(models["one buffer"].trainable_weights)
        print(f"# {args.model} ({tensors} gradient tensors), batch {args.batch_size} per rank, "
              f"{size} ranks, 1 TF thread each; median over {args.reps} blocks of {args.steps} "
              "steps, kinds alternating")
        print(f"# {'rank':>4} " + " ".join(f"{k:>11}" for k in kinds)
              + "  separate - one buffer  (ms per step)")
        for r, (m, _) in enumerate(everyone):
            print(f"  {r:>4} " + " ".join(f"{m[k]:11.3f}" for k in kinds)
                  + f"  {m['separate'] - m['one buffer']:21.3f}")
        print(f"# #wrong {wrong} (ranks whose keras_dist models differ from rank 0's)")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
