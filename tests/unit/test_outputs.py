"""The pool of large collective outputs: memory is reused only when nothing refers to it."""

import numpy as np

from keras_dist.tensor.outputs import OutputPool

F32 = np.dtype(np.float32)


def test_pool_reuses_a_block_only_after_every_view_is_gone():
    pool = OutputPool(min_bytes=1024, max_bytes=1 << 20)
    a = pool.empty((256,), F32)
    b = pool.empty((256,), F32)
    assert not np.shares_memory(a, b)
    view = a[10:].reshape(-1, 3)
    del a
    c = pool.empty((16, 16), F32)
    assert not np.shares_memory(c, view) and not np.shares_memory(c, b)
    kept = np.asarray(view).ctypes.data
    del view
    d = pool.empty((64, 4), F32)
    assert d.ctypes.data <= kept < d.ctypes.data + d.nbytes  # a's block, now unused
    d[:] = 7.0
    assert np.all(d == 7.0) and d.shape == (64, 4) and d.flags.c_contiguous


def test_pool_bounds_its_memory_and_skips_small_or_huge_arrays():
    pool = OutputPool(min_bytes=1024, max_bytes=4096)
    small = pool.empty((10,), np.dtype(np.float64))
    huge = pool.empty((2048,), np.dtype(np.float64))
    assert small.base is None and huge.base is None  # plain arrays, not pooled
    held = [pool.empty((256,), F32) for _ in range(5)]  # 1 KiB each, 4 KiB cap
    assert sum(a.base is not None for a in held) == 4
    del held
    again = pool.empty((512,), F32)  # 2 KiB: drops unused 1 KiB blocks to fit
    assert again.base is not None and sum(b.nbytes for b in pool._blocks) <= 4096
    again[:] = 1.0
    pool.clear()
    assert not pool._blocks and again.sum() == 512  # handed-out memory stays valid


def test_min_bytes_per_call_pools_smaller_arrays():
    pool = OutputPool(min_bytes=1 << 16, max_bytes=1 << 20)
    assert pool.empty((256,), F32).base is None
    pooled = pool.empty((256,), F32, min_bytes=1024)
    assert pooled.base is not None and pool._blocks[-1].nbytes == 1024
