"""Host cost of one training step's gradient allreduce, without the model's compute.

    kdrun -np 2 python benchmarks/grad_allreduce_cost.py [--model mlp] [--calls 200] [--reps 9]

Every rank makes TF tensors shaped like the trainable variables of a
``keras_dist.bench train`` model (random values, float32), and times a
``tf.function`` that does what ``DistributedOptimizer`` does inside ``fit``:
``kd.grouped_allreduce`` of the tensors (Average; one op: keras_dist's
``KerasDistAllreduce``, or ``tf.numpy_function`` with ``KERAS_DIST_TF_OP=0``),
then reads every result once (``tf.reduce_sum``, as the optimizer's
update would). ``--reps`` barrier-started blocks of ``--calls`` calls; a
block's time per call is the slowest rank's; rank 0 prints the median and
the fastest block, and the time of the same function without the allreduce
(the reads alone), timed in alternating blocks. The last call's results are
checked against the float64 average of every rank's tensors (each rank
regenerates the others' from their seeds).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=("mlp", "cnn", "resnet-small"))
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()

    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from mpi4py import MPI

    import keras_dist as kd
    from keras_dist.bench import train

    kd.init()
    rank, size = kd.rank(), kd.size()
    shapes = [tuple(v.shape) for v in train.build_model(args.model).trainable_variables]

    def values(r):
        rng = np.random.default_rng([7, r])
        return [rng.standard_normal(s).astype(np.float32) for s in shapes]

    tensors = [tf.constant(v) for v in values(rank)]

    @tf.function
    def reduce_and_read(xs):
        return tf.add_n([tf.reduce_sum(r) for r in kd.grouped_allreduce(xs)])

    @tf.function
    def read(xs):
        return tf.add_n([tf.reduce_sum(x) for x in xs])

    comm = MPI.COMM_WORLD
    calls = [reduce_and_read, read]
    for call in calls:
        for _ in range(20):
            call(tensors)
    times = np.empty((len(calls), args.reps))
    for rep in range(args.reps):
        for index, call in enumerate(calls):
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(args.calls):
                call(tensors)
            times[index, rep] = (time.perf_counter() - start) / args.calls
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)

    got = [r.numpy() for r in tf.function(kd.grouped_allreduce)(tensors)]
    want = [np.mean([v[i].astype(np.float64) for v in map(values, range(size))], axis=0)
            for i in range(len(shapes))]
    wrong = sum(int(np.sum(np.abs(g - w) > 1e-6 * (1 + np.abs(w)))) for g, w in zip(got, want))
    wrong = comm.allreduce(wrong)
    if rank == 0:
        nbytes = sum(int(np.prod(s)) * 4 for s in shapes)
        print(f"{args.model}: {len(shapes)} gradients, {nbytes} bytes, {size} ranks; "
              f"median (fastest) of {args.reps} blocks of {args.calls} calls, slowest rank")
        for label, row in zip(("grouped_allreduce + read", "read alone"), times):
            print(f"  {label:26s} {np.median(row) * 1e3:7.3f} ms ({row.min() * 1e3:.3f})")
        print(f"  allreduce's share: {(np.median(times[0]) - np.median(times[1])) * 1e3:.3f} ms;"
              f" #wrong {wrong}")
    if wrong:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
