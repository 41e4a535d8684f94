"""alltoall, reducescatter and the grouped collectives in one process (size 1)."""

import numpy as np
import pytest

import keras_dist as kd
from keras_dist.tensor.exchange import own_rows


@pytest.fixture(scope="module", autouse=True)
def group():
    kd.init()
    yield
    kd.shutdown()


@pytest.mark.parametrize("rows,size", [(8, 4), (9, 4), (11, 4), (3, 4), (0, 3), (5, 1)])
def test_own_rows_cover_the_rows_in_order(rows, size):
    spans = [own_rows(rows, size, rank) for rank in range(size)]
    assert spans[0][0] == 0 and spans[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    counts = [end - begin for begin, end in spans]
    assert max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)


def test_size_one_results_are_copies_of_the_input():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 3))
    received = kd.alltoall(x)
    np.testing.assert_array_equal(received, x)
    assert not np.shares_memory(received, x)
    received, splits = kd.alltoall(x, [3])
    np.testing.assert_array_equal(received, x[:3])
    assert splits.tolist() == [3] and splits.dtype == np.int32
    scattered = kd.reducescatter(x, op=kd.Sum)
    np.testing.assert_array_equal(scattered, x)
    assert not np.shares_memory(scattered, x)
    np.testing.assert_allclose(kd.reducescatter(x, prescale_factor=2.0, postscale_factor=0.25),
                               x * 0.5)
    gathered = kd.grouped_allgather([x, np.int8(3)])
    np.testing.assert_array_equal(gathered[0], x)
    assert gathered[1].tolist() == [3] and gathered[1].dtype == np.int8
    assert kd.grouped_allgather([]) == [] and kd.grouped_reducescatter([]) == []


def test_bad_arguments_are_explained():
    x = np.ones((4, 2), np.float32)
    with pytest.raises(ValueError, match=r"`splits` must be a vector of 1 integers"):
        kd.alltoall(x, [2, 2])
    with pytest.raises(ValueError, match=r"at most the first dimension of `x`\. "
                                         r"Received: splits=\[5\] \(sum 5\), x\.shape=\(4, 2\)"):
        kd.alltoall(x, [5])
    with pytest.raises(ValueError, match="op=Average and op=Sum"):
        kd.reducescatter(x, op=kd.Max)
    with pytest.raises(TypeError, match="`reducescatter` supports"):
        kd.reducescatter(np.array([True, False]))
    with pytest.raises(TypeError, match="list or tuple"):
        kd.grouped_reducescatter(x)
