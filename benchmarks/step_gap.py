"""Where a keras_dist training step's extra time goes, by taking the parts away one at a time.

    kdrun -np 2 python benchmarks/step_gap.py [--model mlp] [--steps 60] [--reps 7]

Every rank trains the same ``keras_dist.bench train`` model (``train_on_batch``,
SGD, batch 32, one TensorFlow thread) in four kinds of blocks, alternating,
each after a barrier and 3 untimed steps:

- ``plain``: plain Keras, every rank at once (the contention baseline);
- ``host call``: ``DistributedOptimizer``, but the gradients' collective
  replaced by a local copy into the same 64-byte-aligned outputs: the
  ``tf.numpy_function`` hand-over, the Python around it and a copy of the
  gradients, with no exchange and no waiting;
- ``+ sync``: the same plus a 4-byte ``kd.allreduce`` inside the host call,
  so the ranks wait for each other once a step but move no gradients;
- ``keras_dist``: the real gradient allreduce.

Rank 0 prints each rank's median step time of each kind (median over the
blocks of the mean step in a block) and the differences: host call, waiting
for the slowest rank, moving the gradients. The replaced models train on
their own gradients, the real one on the average: at the end, the real
model's weights must be equal on every rank (checked, float64 sums of every
variable; a mismatch exits 1).

It measures the ``tf.numpy_function`` path (``KERAS_DIST_TF_OP=0``, set
here): the replacements below hook that path's Python, which keras_dist's
own op (the default since 2026-12-05) never enters. The op's steps are
broken down by ``python -m keras_dist.bench train --breakdown``.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["KERAS_DIST_TF_OP"] = "0"  # the path this script measures (see above)

import _blocks  # noqa: E402  (this folder's shared pieces)


def main() -> int:
    args = _blocks.parse_args(__doc__.split("\n\n")[0], model="mlp", reps=7)
    _blocks.one_thread()
    import keras
    import numpy as np

    import keras_dist as kd
    from keras_dist.bench import train
    from keras_dist.tensor import fusion, ops

    real = ops._allreduce_arrays
    mode = {"kind": "keras_dist"}
    sync = np.ones(1, np.float32)

    def local_or_real(arrays, *rest, **options):
        """The gradients' collective as the block's kind asks (the ``tf.numpy_function``
        of ``DistributedOptimizer`` calls ``ops._allreduce_arrays``)."""
        if mode["kind"] == "keras_dist":
            return real(arrays, *rest, **options)
        if mode["kind"] == "+ sync":
            kd.allreduce(sync, op=kd.Sum, name="step_gap sync")
        results = fusion.aligned_like(arrays)
        for result, array in zip(results, arrays):
            np.copyto(result, array)
        return results

    ops._allreduce_arrays = local_or_real
    kd.init()
    rank, size = kd.rank(), kd.size()
    x, y = _blocks.batch(args.model, args.batch_size, rank)

    def compiled(optimizer):
        return train._compiled(args.model, optimizer)

    models = {"plain": compiled(keras.optimizers.SGD(0.01)),
              "host call": compiled(kd.DistributedOptimizer(keras.optimizers.SGD(0.01))),
              "keras_dist": compiled(kd.DistributedOptimizer(keras.optimizers.SGD(0.01)))}
    models["+ sync"] = models["host call"]
    kinds = ["plain", "host call", "+ sync", "keras_dist"]
    medians = _blocks.median_steps(models, kinds, x, y, args.steps, args.reps,
                                   before=lambda kind: mode.update(kind=kind))
    mode["kind"] = "keras_dist"
    everyone, wrong = _blocks.gather_checked(medians, [models["keras_dist"]])
    if rank == 0:
        print(f"# {args.model}, batch {args.batch_size} per rank, {size} ranks, 1 TF thread "
              f"each; median over {args.reps} blocks of {args.steps} steps, kinds alternating")
        print(f"# {'rank':>4} " + " ".join(f"{k:>11}" for k in kinds)
              + "   host call  waiting   moving   (ms per step)")
        for r, m in enumerate(everyone):
            print(f"  {r:>4} " + " ".join(f"{m[k]:11.2f}" for k in kinds)
                  + f"   {m['host call'] - m['plain']:9.2f} {m['+ sync'] - m['host call']:8.2f}"
                  f" {m['keras_dist'] - m['+ sync']:8.2f}")
        print(f"# keras_dist / plain: {everyone[0]['plain'] / everyone[0]['keras_dist']:.3f}"
              f" (rank 0); #wrong {wrong} (ranks whose averaged model differs from rank 0's)")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
