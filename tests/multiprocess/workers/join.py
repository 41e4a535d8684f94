"""``join`` with uneven data, checked on every rank.

Rank r has ``STEPS[r]`` batches; every rank can regenerate every rank's data
(seeded by step and rank), so the reference for each step (the ranks still
active add their data, joined ranks add the op's identity, ``Average``
divides by the full size) is computed here in float64, independently of the
transport. Prints "JOIN <check> passed rank=R" per check and "JOIN OK ..." at
the end.
"""

import os

import numpy as np

import keras_dist as kd
from tests.multiprocess.workers._checks import run_checks

kd.init()
RANK, SIZE = kd.rank(), kd.size()


def data(step, rank, shape=(5, 3), dtype=np.float64):
    rng = np.random.default_rng([step, rank, 7])
    values = rng.normal(size=shape) * 10
    return values.astype(dtype) if np.dtype(dtype).kind == "f" else np.round(values).astype(dtype)


def steps(first_to_join):
    """Batches per rank: ``first_to_join`` has one, the others one more per rank."""
    return [1 if r == first_to_join else 2 + r for r in range(SIZE)]


def last_to_join(counts):
    most = max(counts)
    return max(r for r, c in enumerate(counts) if c == most)


def check_uneven(first_to_join, op, dtype):
    counts = steps(first_to_join)
    for step in range(counts[RANK]):
        mine = data(step, RANK, dtype=dtype)
        got = kd.allreduce(mine, op=op, name=f"step {step}")
        active = [data(step, r, dtype=np.float64) if np.dtype(dtype).kind == "f"
                  else data(step, r, dtype=dtype).astype(np.float64)
                  for r in range(SIZE) if counts[r] > step]
        if op is kd.Sum:
            want = np.sum(active, axis=0)
        elif op is kd.Average:
            want = np.sum(active, axis=0) / SIZE
            if np.dtype(dtype).kind != "f":
                want = np.floor(want)
        elif op is kd.Min:
            want = np.min(active, axis=0)
        else:
            want = np.max(active, axis=0)
        assert got.dtype == np.dtype(dtype), got.dtype
        tolerance = 1e-4 if dtype == np.float32 else 1e-12
        assert np.allclose(got, want, rtol=tolerance, atol=tolerance), (step, op, got, want)
    last = kd.join()
    assert last == last_to_join(counts), (last, counts)
    # The group is whole again.
    assert np.array_equal(kd.allreduce(np.array([RANK + 1.0]), op=kd.Sum),
                          [SIZE * (SIZE + 1) / 2])


def test_sum_and_average_float():
    for first in range(SIZE):
        check_uneven(first, kd.Sum, np.float64)
        check_uneven(first, kd.Average, np.float32)


def test_min_max_and_integers():
    check_uneven(0, kd.Min, np.float32)
    check_uneven(SIZE - 1, kd.Max, np.float64)
    check_uneven(0, kd.Sum, np.int32)
    check_uneven(0, kd.Average, np.int64)


def test_grouped_tensors_while_joined():
    counts = steps(0)
    for step in range(counts[RANK]):
        xs = [data(step, RANK, shape=(4,)), data(step, RANK, shape=(2, 2), dtype=np.float32),
              data(step, RANK, shape=(3,), dtype=np.int64)]
        got = kd.grouped_allreduce(xs, op=kd.Sum)
        for index, (value, dtype, shape) in enumerate(
                [(got[0], np.float64, (4,)), (got[1], np.float32, (2, 2)),
                 (got[2], np.int64, (3,))]):
            want = sum(data(step, r, shape=shape, dtype=dtype).astype(np.float64)
                       for r in range(SIZE) if counts[r] > step)
            assert np.allclose(value, want, rtol=1e-5), (index, value, want)
    assert kd.join() == last_to_join(counts)


def test_other_collectives_raise_while_ranks_joined():
    if SIZE == 1:
        return
    if RANK == 0:
        assert kd.join() == SIZE - 1
    else:
        try:
            kd.broadcast(np.arange(3.0), root_rank=1)
        except kd.CollectiveMismatchError as error:
            assert "have called `join()`" in str(error) and "[0]" in str(error), error
        else:
            raise AssertionError("broadcast ran while rank 0 had joined")
        got = kd.allreduce(np.array([float(RANK)]), op=kd.Sum)
        assert got[0] == sum(range(1, SIZE)), got
        assert kd.join() == SIZE - 1
    kd.barrier()


def test_mismatch_without_join_still_raises():
    if SIZE == 1:
        return
    try:
        kd.allreduce(np.ones(3 + RANK), op=kd.Sum)
    except kd.CollectiveMismatchError as error:
        assert "join" not in str(error), error
    else:
        raise AssertionError("a mismatch passed")
    assert kd.allreduce(np.array([1.0]), op=kd.Sum)[0] == SIZE


def test_tensorflow_values_while_joined():
    if os.environ.get("JOIN_SKIP_TF"):
        return
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    counts = steps(SIZE - 1)

    @tf.function
    def reduced(x):
        return kd.allreduce(x, op=kd.Average)

    for step in range(counts[RANK]):
        got = reduced(tf.constant(data(step, RANK, dtype=np.float32))).numpy()
        want = sum(data(step, r) for r in range(SIZE) if counts[r] > step) / SIZE
        assert np.allclose(got, want, rtol=1e-5, atol=1e-5), (got, want)
    assert kd.join() == last_to_join(counts)


def test_fit_on_uneven_data():
    """``fit`` with rank r holding 2 + r batches, JoinCallback first: every rank
    ends with the same weights, equal to a reference in which the ranks that
    ran out add nothing and the average still divides by the full size."""
    if os.environ.get("JOIN_SKIP_TF"):
        return
    import keras
    import tensorflow as tf

    batch, lr = 4, 0.1
    counts = [2 + r for r in range(SIZE)]

    def rank_data(rank):
        rng = np.random.default_rng([rank, 11])
        x = rng.normal(size=(counts[rank] * batch, 3)).astype(np.float32)
        return x, (x @ np.array([[1.0], [-2.0], [0.5]], np.float32)
                   + rng.normal(size=(len(x), 1)).astype(np.float32))

    def model():
        keras.utils.set_random_seed(5)
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])

    trained = model()
    trained.compile(optimizer=kd.DistributedOptimizer(keras.optimizers.SGD(lr)), loss="mse")
    x, y = rank_data(RANK)
    callbacks = [kd.callbacks.JoinCallback(), kd.callbacks.MetricAverageCallback()]
    trained.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0,
                callbacks=callbacks)
    assert callbacks[0].last_joined_rank in (None, SIZE - 1), callbacks[0].last_joined_rank

    reference = model()
    weights = [w.numpy().astype(np.float64) for w in reference.weights]
    data = [rank_data(r) for r in range(SIZE)]
    for _ in range(2):
        for step in range(max(counts)):
            total = [np.zeros_like(w) for w in weights]
            for r in range(SIZE):
                if step >= counts[r]:
                    continue
                xb = data[r][0][step * batch:(step + 1) * batch].astype(np.float64)
                yb = data[r][1][step * batch:(step + 1) * batch].astype(np.float64)
                error = xb @ weights[0] + weights[1] - yb
                total[0] += 2 * xb.T @ error / error.size
                total[1] += 2 * error.sum(axis=0) / error.size
            weights = [w - lr * g / SIZE for w, g in zip(weights, total)]
    got = [w.numpy() for w in trained.weights]
    for g, w in zip(got, weights):
        assert np.allclose(g, w, rtol=1e-4, atol=1e-5), (g, w)
    everyone = kd.allgather_object([g.tobytes() for g in got])
    assert all(other == everyone[0] for other in everyone), "weights differ between ranks"
    del tf


if __name__ == "__main__":
    run_checks([function for name, function in list(globals().items())
                if name.startswith("test_")],
               rank=RANK, passed="JOIN {name} passed rank={rank}", agree=kd.allgather_object)
    print(f"JOIN OK rank={RANK} size={SIZE}", flush=True)
