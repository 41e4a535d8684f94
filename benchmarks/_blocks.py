"""What this folder's training comparisons use (``overlap_probe.py``).

Their arguments, one TensorFlow thread per rank, every rank's batch, the
alternating timed blocks and the check that models ended equal on every rank.
The scripts run as ``python benchmarks/NAME.py``, which puts this folder on
``sys.path``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable


def parse_args(description: str, model: str, reps: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default=model, help="a keras_dist.bench train model")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per block")
    parser.add_argument("--reps", type=int, default=reps, help="blocks of each kind")
    return parser.parse_args()


def one_thread() -> None:
    """TensorFlow on one intra-op and one inter-op thread (before anything runs)."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)


def batch(model: str, batch_size: int, rank: int):
    """This rank's synthetic batch (x, y) for a ``keras_dist.bench train`` model."""
    import numpy as np

    from keras_dist.bench import train

    rng = np.random.default_rng([1234, rank])
    x = rng.normal(size=(batch_size, *train.build_model(model).input_shape[1:]))
    return x.astype("float32"), rng.integers(0, 10, size=(batch_size,))


def median_steps(models: dict, kinds: list[str], x, y, steps: int, reps: int,
                 before: Callable[[str], None] = lambda kind: None) -> dict[str, float]:
    """Each kind's median (over ``reps`` blocks) of its mean step in ms: the
    kinds' blocks alternate, their order reversed every other round; each block
    starts after ``before(kind)``, a barrier and 3 untimed steps."""
    import numpy as np

    import keras_dist as kd

    blocks: dict[str, list[float]] = {k: [] for k in kinds}
    for rep in range(reps):
        for kind in kinds if rep % 2 == 0 else kinds[::-1]:
            before(kind)
            model = models[kind]
            kd.barrier()
            for _ in range(3):
                model.train_on_batch(x, y)
            start = time.perf_counter()
            for _ in range(steps):
                model.train_on_batch(x, y)
            blocks[kind].append((time.perf_counter() - start) / steps)
    return {k: 1e3 * float(np.median(v)) for k, v in blocks.items()}


def gather_checked(medians: dict[str, float], models: list) -> tuple[list[dict], int]:
    """Every rank's medians, and how many ranks' ``models`` differ from rank 0's
    (float64 sums of every variable)."""
    import numpy as np

    import keras_dist as kd

    sums = [[float(np.sum(np.asarray(w, np.float64))) for w in m.get_weights()] for m in models]
    everyone = kd.allgather_object((medians, sums))
    wrong = sum(s != everyone[0][1] for _, s in everyone)
    return [m for m, _ in everyone], wrong
