"""DLPack capsules read and retargeted in place (``tensor.dlpack``), and what
``tf_glue`` does with them: TensorFlow's logical GPU numbers mapped to CUDA
devices and back, and tensors placed on a GPU but kept in host memory (int32)
left to the host path. No GPU here: numpy's and TensorFlow's CPU capsules
have the same layout, and a stand-in for cupy answers where memory is."""

import types

import numpy as np
import pytest

from keras_dist.tensor import dlpack

tf = pytest.importorskip("tensorflow", reason="needs tensorflow (the test extra installs it)")

from keras_dist.tensor.tf import glue as tf_glue  # noqa: E402


def test_a_legacy_capsule_is_read_and_retargeted():
    array = np.arange(5, dtype=np.float32)
    capsule = array.__dlpack__()
    assert dlpack.data_pointer(capsule) == array.ctypes.data
    assert dlpack.device(capsule) == (dlpack.KDL_CPU, 0)
    dlpack.set_device_id(capsule, 3)
    assert dlpack.device(capsule) == (dlpack.KDL_CPU, 3)
    assert dlpack.data_pointer(capsule) == array.ctypes.data  # nothing else moved


def test_a_versioned_capsule_is_read_and_retargeted():
    array = np.arange(6, dtype=np.int64).reshape(2, 3)
    try:
        capsule = array.__dlpack__(max_version=(1, 0))
    except TypeError:
        pytest.skip(f"numpy {np.__version__} makes no versioned capsules")
    assert dlpack.data_pointer(capsule) == array.ctypes.data
    dlpack.set_device_id(capsule, 7)
    assert dlpack.device(capsule) == (dlpack.KDL_CPU, 7)


def test_a_consumed_capsule_is_refused_with_its_name():
    capsule = np.ones(2).__dlpack__()
    np.from_dlpack(types.SimpleNamespace(__dlpack__=lambda **kw: capsule,
                                         __dlpack_device__=lambda: (dlpack.KDL_CPU, 0)))
    with pytest.raises(ValueError, match="unconsumed.*Received: a capsule named b'used_dltensor'"):
        dlpack.device(capsule)


class _Tensor:
    """A TensorFlow tensor as the device path sees it: where its op ran and
    where DLPack says its memory is."""

    def __init__(self, device, memory):
        self.device = device
        self._memory = memory

    def __dlpack_device__(self):
        return self._memory


GPU0 = "/job:localhost/replica:0/task:0/device:GPU:0"


def test_int32_placed_on_a_gpu_but_kept_in_host_memory_takes_the_host_path():
    assert tf_glue.on_gpu(_Tensor(GPU0, (dlpack.KDL_CUDA, 0)))
    int32_on_gpu = _Tensor(GPU0, (dlpack.KDL_CPU, 0))  # TensorFlow's host-memory int32
    assert not tf_glue.on_gpu(int32_on_gpu)
    assert tf_glue.device_module([_Tensor(GPU0, (dlpack.KDL_CUDA, 0)), int32_on_gpu]) is None
    assert not tf_glue.on_gpu(tf.constant([1, 2]))  # a CPU tensor


class _Cupy:
    """Stands in for cupy: says which CUDA device holds an address."""

    def __init__(self, device):
        self.asked = []
        runtime = types.SimpleNamespace(pointerGetAttributes=self._attributes)
        self.cuda = types.SimpleNamespace(runtime=runtime)
        self._device = device

    def _attributes(self, pointer):
        self.asked.append(pointer)
        return types.SimpleNamespace(device=self._device)


def test_the_cuda_device_comes_from_the_memory_once_per_logical_gpu(monkeypatch):
    # Horovod's recipe on rank 1: TensorFlow's GPU:0 is CUDA device 1.
    monkeypatch.setattr(tf_glue, "_CUDA_DEVICE", {})
    fake_cupy = _Cupy(device=1)
    tensor = tf.constant(np.arange(4, dtype=np.float32))
    assert tf_glue.cuda_device(tensor, fake_cupy) == 1
    assert tf_glue.cuda_device(tf.constant([5.0]), fake_cupy) == 1
    assert len(fake_cupy.asked) == 1  # asked once, then remembered
    assert fake_cupy.asked[0] == dlpack.data_pointer(tf.experimental.dlpack.to_dlpack(tensor))


def test_capsules_name_the_cuda_device_to_cupy_and_the_logical_one_back(monkeypatch):
    tensor = tf.constant(np.arange(3, dtype=np.float32))
    export = tf_glue._Export(tensor, 1)  # noqa: SLF001 - the hand-over itself
    assert export.__dlpack_device__() == (dlpack.KDL_CPU, 1)
    assert dlpack.device(export.__dlpack__()) == (dlpack.KDL_CPU, 1)

    class OnDeviceOne:  # a result whose capsule names CUDA device 1
        def __init__(self, array):
            self.array = array

        def __dlpack__(self, **kwargs):
            capsule = self.array.__dlpack__()
            dlpack.set_device_id(capsule, 1)
            return capsule

    seen = []
    take = tf.experimental.dlpack.from_dlpack

    def from_dlpack(capsule):
        seen.append(dlpack.device(capsule))
        return take(capsule)

    monkeypatch.setattr(tf.experimental.dlpack, "from_dlpack", from_dlpack)
    result = np.array([4.0, 5.0, 6.0], np.float32)
    (back,) = tf_glue.from_device_arrays([OnDeviceOne(result)], [tensor], np)
    assert seen == [(dlpack.KDL_CPU, 0)]  # the template's logical number, not 1
    np.testing.assert_array_equal(back.numpy(), result)
