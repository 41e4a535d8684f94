"""A text model's embedding gradient: allgathered rows against a dense allreduce.

    kdrun -np 2 python benchmarks/sparse_gradients.py [--vocab 5000] [--iters 12] [--steps 10]

One job holds three copies of a small text classifier (Embedding(vocab, 64),
GRU(64), Dense(10) on 40 token ids, batch 32 per rank, token ids uniform
below ``--vocab``): keras_dist's ``DistributedOptimizer`` with
``sparse_as_dense=False`` (Horovod's default: the embedding's
``IndexedSlices`` gradient reduced by allgathers of its rows), the same with
``sparse_as_dense=True`` (densified, in the step's grouped allreduce), and
plain Keras (every rank training alone). Blocks of ``--steps``
``train_on_batch`` steps run in turn, the order reversed every other
iteration, each block started by a barrier; rank 0 prints each kind's median
step over blocks (mean over ranks). TensorFlow runs one thread per rank.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _model(vocab: int):
    import keras

    keras.utils.set_random_seed(1)
    tokens = keras.Input((40,), dtype="int32")
    x = keras.layers.GRU(64)(keras.layers.Embedding(vocab, 64)(tokens))
    return keras.Model(tokens, keras.layers.Dense(10)(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=5000)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    import numpy as np

    import keras_dist as kd
    from keras_dist.bench import train

    kd.init()
    rank = kd.rank()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    kinds = {"sparse (allgathered rows)": False, "sparse_as_dense=True": True, "plain Keras": None}
    models = {}
    for kind, dense in kinds.items():
        model = _model(args.vocab)
        optimizer = keras.optimizers.SGD(0.01)
        if dense is not None:
            optimizer = kd.DistributedOptimizer(optimizer, sparse_as_dense=dense)
        model.compile(optimizer=optimizer, loss=loss)
        models[kind] = model
    x, y = train.random_batch(models["plain Keras"], 32, np.random.default_rng([3, rank]))
    for model in models.values():
        for _ in range(3):
            model.train_on_batch(x, y)
    steps = {kind: [] for kind in kinds}
    order = list(kinds)
    for iteration in range(args.iters):
        for kind in order if iteration % 2 == 0 else order[::-1]:
            kd.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                models[kind].train_on_batch(x, y)
            steps[kind].append((time.perf_counter() - start) / args.steps)
    everyone = kd.allgather_object(steps)
    if rank == 0:
        print(f"# {kd.size()} ranks, vocab {args.vocab}, {args.iters} blocks of {args.steps} "
              "steps per kind; median step over blocks (mean over ranks), ms")
        for kind in kinds:
            per_block = np.mean([s[kind] for s in everyone], axis=0)
            print(f"  {kind:<28} {1e3 * np.median(per_block):7.2f}")


if __name__ == "__main__":
    main()
