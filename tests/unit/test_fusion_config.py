"""Fusion planning, settings parsing and the dtype table, in one process."""

import ml_dtypes
import numpy as np
import pytest

from keras_dist import _vocab as _dtypes
from keras_dist._config import Config
from keras_dist.tensor import fusion


def test_buckets_group_by_dtype_in_first_appearance_order():
    arrays = [np.ones(4, np.float32), np.ones(2, np.int64), np.ones(3, np.float32),
              np.ones(0, np.float32), np.ones(5, np.int64)]
    assert fusion.plan_buckets(arrays, 1 << 20) == [[0, 2], [1, 4]]


def test_buckets_split_at_threshold_and_oversized_array_alone():
    arrays = [np.ones(10, np.float32), np.ones(10, np.float32), np.ones(100, np.float32),
              np.ones(5, np.float32)]
    assert fusion.plan_buckets(arrays, 80) == [[0, 1], [2], [3]]


def test_pack_unpack_round_trip_with_scale():
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in [(2, 3), (), (4,)]]
    flat = np.empty(sum(a.size for a in arrays), np.float32)
    fusion.pack(arrays, flat, scale=2.0)
    restored = fusion.unpack(flat, arrays, scale=0.25)
    for original, back in zip(arrays, restored):
        assert back.shape == original.shape
        np.testing.assert_allclose(back, original * 0.5, rtol=1e-6)


def test_aligned_like_gives_disjoint_aligned_views_of_one_buffer():
    arrays = [np.ones((3, 5), np.float32), np.ones((), np.int64), np.ones(7, np.float16),
              np.ones((2, 2), ml_dtypes.bfloat16), np.ones(0, np.float64), np.ones(1, np.bool_)]
    out = fusion.aligned_like(arrays)
    spans = []
    for array, result in zip(arrays, out):
        assert (result.shape, result.dtype) == (array.shape, array.dtype)
        assert result.flags.c_contiguous and result.flags.writeable
        if not result.size:  # numpy may give an empty view any address
            continue
        assert result.ctypes.data % fusion.ALIGN_BYTES == 0
        assert result.base is not None and result.base is out[0].base
        spans.append((result.ctypes.data, result.ctypes.data + result.nbytes))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def test_aligned_like_recycles_a_large_group_once_nothing_refers_to_it():
    arrays = [np.ones((300, 300), np.float32), np.ones(1000, np.float32)]  # ~364 KB
    assert sum(a.nbytes for a in arrays) >= fusion.GROUP_POOL_MIN_BYTES
    first = fusion.aligned_like(arrays)
    first[0][:] = 3.0
    held = first[1]  # one view alive keeps the whole buffer
    del first
    second = fusion.aligned_like(arrays)
    assert not np.shares_memory(second[1], held)
    address = held.ctypes.data
    del held
    third = fusion.aligned_like(arrays)
    assert third[1].ctypes.data == address  # the same memory, faulted in once
    assert not any(np.shares_memory(a, b) for a in second for b in third)
    small = fusion.aligned_like([np.ones(10, np.float32)])
    assert small[0].base.nbytes < fusion.GROUP_POOL_MIN_BYTES  # small groups: not pooled


def test_unpack_into_given_outputs():
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in [(4, 3), (5,)]]
    flat = np.concatenate([a.ravel() for a in arrays])
    out = fusion.aligned_like(arrays)
    restored = fusion.unpack(flat, arrays, scale=0.5, out=out)
    assert all(r is o for r, o in zip(restored, out))
    for original, back in zip(arrays, restored):
        np.testing.assert_array_equal(back, original * np.float32(0.5))


def test_config_reads_keras_dist_and_horovod_spellings(monkeypatch):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1024")
    monkeypatch.setenv("HOROVOD_STALL_CHECK_TIME_SECONDS", "5")
    monkeypatch.setenv("KERAS_DIST_CPU_OPERATIONS", "MPI")
    config = Config.from_env()
    assert config.fusion_threshold_bytes == 1024
    assert config.stall_check_seconds == 5.0
    assert config.cpu_operations == "mpi"
    monkeypatch.setenv("KERAS_DIST_FUSION_THRESHOLD", "2048")
    assert Config.from_env().fusion_threshold_bytes == 2048


def test_config_reads_single_copy_settings(monkeypatch):
    assert Config.from_env().shm_single_copy == "auto"
    assert Config.from_env().shm_single_copy_bytes == 1 << 20
    monkeypatch.setenv("KERAS_DIST_SHM_SINGLE_COPY", "OFF")
    monkeypatch.setenv("KERAS_DIST_SHM_SINGLE_COPY_BYTES", "65536")
    config = Config.from_env()
    assert config.shm_single_copy == "off" and config.shm_single_copy_bytes == 65536


@pytest.mark.parametrize("name, value, message", [
    ("KERAS_DIST_SHM_SINGLE_COPY", "always", "must be one of"),
    ("KERAS_DIST_CPU_OPERATIONS", "gloo", "must be one of"),
    ("KERAS_DIST_FUSION_THRESHOLD", "lots", "must be a number"),
    ("KERAS_DIST_FUSION_THRESHOLD", "1.5", "whole number"),
    ("KERAS_DIST_TIMEOUT_SECONDS", "-3", ">= 0"),
])
def test_config_rejects_bad_values_naming_them(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message) as info:
        Config.from_env()
    assert name in str(info.value) and value in str(info.value)


def test_dtype_table():
    assert _dtypes.dtype_code(np.float32) == _dtypes.FLOAT32
    assert _dtypes.dtype_code(ml_dtypes.bfloat16) == _dtypes.BFLOAT16
    assert _dtypes.is_half(np.float16) and not _dtypes.is_half(np.float64)
    with pytest.raises(TypeError, match="complex128"):
        _dtypes.dtype_code(np.complex128)
