"""Horovod's capability queries answer for this package, truthfully."""

import importlib.util

import pytest

import keras_dist as kd


def test_mpi_is_built_and_enabled_once_initialised():
    assert kd.mpi_built() is True
    kd.init()
    assert kd.mpi_enabled() is True
    assert isinstance(kd.mpi_threads_supported(), bool)
    kd.shutdown()
    assert kd.mpi_enabled() is False
    with pytest.raises(ValueError, match="init"):
        kd.mpi_threads_supported()


def test_backends_that_are_not_part_of_keras_dist():
    assert (kd.gloo_built(), kd.gloo_enabled(), kd.ddl_built(), kd.ccl_built()) == (
        False, False, False, False)


def test_gpu_queries_follow_cupy():
    has_cupy = importlib.util.find_spec("cupy") is not None
    if not has_cupy:
        assert (kd.nccl_built(), kd.cuda_built(), kd.rocm_built()) == (0, False, False)
    else:
        assert isinstance(kd.nccl_built(), int)
        assert kd.cuda_built() != kd.rocm_built()
