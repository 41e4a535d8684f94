"""What overlapping the gradient allreduce with backpropagation would buy on this machine.

    kdrun -np 2 python benchmarks/overlap_probe.py [--model mlp] [--steps 60] [--reps 21]

keras_dist reduces a traced step's gradients in one host call after the whole
backward pass. Horovod instead hands each gradient to a background thread as
soon as it exists, so that the exchange of the last layers' gradients runs
while the first layers' are still being computed. This probe measures that
design before anyone builds it natively: a Python thread reduces each bucket
(``ops.allreduce_arrays``, the engine as shipped) while TensorFlow goes on;
one host call per bucket starts it (its gradients in the backward pass's
order, last layer first: ``tf.numpy_function`` ops run in the order they were
made) and one per bucket waits for it, after every start. The thread gets the
gradients without a copy (the arrays TensorFlow hands over keep their tensors
alive) and Python switches threads every 20 us (``sys.setswitchinterval``),
both in the overlap's favour.

Every rank trains the same ``keras_dist.bench train`` model four ways
(``train_on_batch``, SGD, batch 32, one TensorFlow thread), in alternating
blocks after a barrier and 3 untimed steps: plain Keras (``plain``),
``DistributedOptimizer`` as shipped (``one call``), and the overlap with the
gradients in 1 and in 3 buckets. Rank 0 prints each rank's median step (over
blocks). Every keras_dist model must end with the same weights on every rank
(checked, float64 sums of every variable; a mismatch exits 1).
"""

from __future__ import annotations

import os
import queue
import sys
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import _blocks  # noqa: E402  (this folder's shared pieces)


class _Reducer:
    """A background thread that averages buckets of arrays, in submission order."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._done: dict[int, object] = {}
        self._ready = threading.Condition()
        self._next = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        from keras_dist._vocab import Average
        from keras_dist.tensor import ops

        while True:
            handle, arrays = self._jobs.get()
            try:
                result = ops.allreduce_arrays(arrays, Average, 1.0, 1.0, f"bucket {handle}")
            except BaseException as error:  # noqa: BLE001  (raised by finish)
                result = error
            with self._ready:
                self._done[handle] = result
                self._ready.notify_all()

    def start(self, *arrays):
        import numpy as np

        self._next += 1
        self._jobs.put((self._next, list(arrays)))
        return np.int64(self._next)

    def finish(self, handle):
        handle = int(handle)
        with self._ready:
            while handle not in self._done:
                self._ready.wait()
            result = self._done.pop(handle)
        if isinstance(result, BaseException):
            raise result
        return result


def _overlapping_sgd(buckets: int, reducer: _Reducer):
    import keras
    import tensorflow as tf

    class OverlappingSGD(keras.optimizers.SGD):
        def apply(self, grads, trainable_variables=None):
            grads = list(grads)
            order = list(range(len(grads)))[::-1]  # the backward pass's order
            n = len(order)
            groups = [order[i * n // buckets:(i + 1) * n // buckets] for i in range(buckets)]
            groups = [g for g in groups if g]
            handles = [tf.numpy_function(reducer.start, [grads[i] for i in g], tf.int64)
                       for g in groups]
            reduced = list(grads)
            for group, handle in zip(groups, handles):
                outs = tf.numpy_function(reducer.finish, [handle],
                                         [grads[i].dtype for i in group])
                for i, out in zip(group, outs):
                    reduced[i] = tf.reshape(out, grads[i].shape)
            return super().apply(reduced, trainable_variables)

    return OverlappingSGD(0.01)


def main() -> int:
    args = _blocks.parse_args(__doc__.split("\n\n")[0], model="mlp", reps=21)
    _blocks.one_thread()
    sys.setswitchinterval(2e-5)
    import keras

    import keras_dist as kd
    from keras_dist.bench import train

    kd.init()
    rank, size = kd.rank(), kd.size()
    x, y = _blocks.batch(args.model, args.batch_size, rank)
    reducer = _Reducer()
    models = {"plain": train.compiled(args.model, keras.optimizers.SGD(0.01)),
              "one call": train.compiled(args.model,
                                          kd.DistributedOptimizer(keras.optimizers.SGD(0.01))),
              "overlap 1": train.compiled(args.model, _overlapping_sgd(1, reducer)),
              "overlap 3": train.compiled(args.model, _overlapping_sgd(3, reducer))}
    kinds = list(models)
    medians = _blocks.median_steps(models, kinds, x, y, args.steps, args.reps)
    everyone, wrong = _blocks.gather_checked(medians, [models[k] for k in kinds[1:]])
    if rank == 0:
        tensors = len(models["one call"].trainable_weights)
        print(f"# {args.model} ({tensors} gradient tensors), batch {args.batch_size} per rank, "
              f"{size} ranks, 1 TF thread each; median over {args.reps} blocks of {args.steps} "
              "steps, kinds alternating")
        print(f"# {'rank':>4} " + " ".join(f"{k:>10}" for k in kinds) + "  (ms per step)")
        for r, m in enumerate(everyone):
            print(f"  {r:>4} " + " ".join(f"{m[k]:10.3f}" for k in kinds))
        print(f"# #wrong {wrong} (ranks whose keras_dist models differ from rank 0's)")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
