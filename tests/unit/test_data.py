"""keras_dist.data.shard: every sample on exactly one rank, equal step counts."""

import numpy as np
import pytest

from keras_dist.data import shard


def _all_parts(data, size, **options):
    return [shard(data, rank=r, size=size, **options) for r in range(size)]


@pytest.mark.parametrize("n", [0, 1, 7, 10, 64, 101])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_every_sample_once_without_batch_size(n, size):
    parts = _all_parts(np.arange(n), size)
    assert sorted(np.concatenate(parts).tolist()) == list(range(n))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.parametrize("n, size, batch", [(24, 2, 4), (26, 2, 4), (51, 3, 4), (9, 3, 1)])
def test_local_batches_are_slices_of_the_global_batches(n, size, batch):
    x = np.arange(n)
    parts = _all_parts((x, x * 10), size, batch_size=batch)
    assert sorted(np.concatenate([p[0] for p in parts]).tolist()) == list(range(n))
    for xs, ys in parts:
        np.testing.assert_array_equal(ys, xs * 10)
    steps = {-(-len(p[0]) // batch) for p in parts}
    assert len(steps) == 1, steps
    for k in range(n // (size * batch)):
        joined = np.concatenate([p[0][k * batch:(k + 1) * batch] for p in parts])
        np.testing.assert_array_equal(joined, x[k * size * batch:(k + 1) * size * batch])


def test_last_global_batch_smaller_than_size():
    with pytest.raises(ValueError, match="drop_remainder"):
        shard(np.arange(9), batch_size=4, rank=0, size=2)
    parts = _all_parts(np.arange(9), 2, batch_size=4, drop_remainder=True)
    assert sorted(np.concatenate(parts).tolist()) == list(range(8))


def test_dict_and_errors():
    parts = _all_parts({"a": np.arange(6), "b": np.arange(6)}, 2)
    assert [p["a"].tolist() for p in parts] == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="same first dimension"):
        shard((np.arange(3), np.arange(4)), rank=0, size=1)
    with pytest.raises(ValueError, match="rank"):
        shard(np.arange(3), rank=2, size=2)


@pytest.mark.parametrize("batch", [None, 3])
def test_tf_datasets(batch):
    tf = pytest.importorskip("tensorflow")
    n, size = 21, 3
    seen = []
    for rank in range(size):
        dataset = shard(tf.data.Dataset.from_tensor_slices((np.arange(n), np.arange(n) * 2)),
                        batch_size=batch, rank=rank, size=size)
        if batch is None:
            dataset = dataset.batch(100)
        for xs, ys in dataset:
            np.testing.assert_array_equal(ys.numpy(), xs.numpy() * 2)
            seen.extend(xs.numpy().tolist())
    assert sorted(seen) == list(range(n))
