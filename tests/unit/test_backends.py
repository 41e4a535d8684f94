"""The Keras layer's per-backend checks: one clear sentence for what is not supported."""

import keras
import pytest

import keras_dist as kd
from keras_dist._keras import backends

pytestmark = pytest.mark.usefixtures("initialised")


def test_a_keras_distribution_setting_is_refused(monkeypatch):
    class DataParallel:
        pass

    monkeypatch.setattr(keras.distribution, "distribution", lambda: DataParallel())
    with pytest.raises(RuntimeError, match="keras.distribution setting.*DataParallel"):
        kd.DistributedOptimizer(keras.optimizers.SGD(0.1))


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="a TensorFlow strategy")
def test_a_tf_distribute_strategy_scope_is_refused():
    import tensorflow as tf

    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        with pytest.raises(RuntimeError, match="tf.distribute strategy scope"):
            kd.DistributedOptimizer(keras.optimizers.SGD(0.1))


def test_unknown_backends_are_refused(monkeypatch):
    monkeypatch.setattr(backends, "name", lambda: "openvino")
    with pytest.raises(NotImplementedError, match="Received: backend='openvino'"):
        backends.check_supported()


def test_host_function_is_the_function_itself_off_torch(monkeypatch):
    monkeypatch.setattr(backends, "name", lambda: "tensorflow")

    def f():
        return 1

    assert backends.host_function(f) is f
