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

It measures the ``tf.numpy_function`` path (``KERAS_DIST_TF_OP=0``, set
here), where the layout applies; keras_dist's own op (the default since
2026-12-05) hands every gradient over as its own output without that cost.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["KERAS_DIST_TF_OP"] = "0"  # the path this script measures (see above)

import _blocks  # noqa: E402  (this folder's shared pieces)


def main() -> int:
    args = _blocks.parse_args(__doc__.split("\n\n")[0], model="cnn", reps=21)
    _blocks.one_thread()
    import keras

    import keras_dist as kd
    from keras_dist.bench import train
    from keras_dist.tensor import conversions

    kd.init()
    rank, size = kd.rank(), kd.size()
    x, y = _blocks.batch(args.model, args.batch_size, rank)

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
    medians = _blocks.median_steps(models, kinds, x, y, args.steps, args.reps)
    everyone, wrong = _blocks.gather_checked(medians, [models["separate"], models["one buffer"]])
    if rank == 0:
        tensors = len(models["one buffer"].trainable_weights)
        print(f"# {args.model} ({tensors} gradient tensors), batch {args.batch_size} per rank, "
              f"{size} ranks, 1 TF thread each; median over {args.reps} blocks of {args.steps} "
              "steps, kinds alternating")
        print(f"# {'rank':>4} " + " ".join(f"{k:>11}" for k in kinds)
              + "  separate - one buffer  (ms per step)")
        for r, m in enumerate(everyone):
            print(f"  {r:>4} " + " ".join(f"{m[k]:11.3f}" for k in kinds)
                  + f"  {m['separate'] - m['one buffer']:21.3f}")
        print(f"# #wrong {wrong} (ranks whose keras_dist models differ from rank 0's)")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
