"""The callbacks in one process (the multi-rank behaviour: tests/multiprocess/test_keras.py)."""

import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import keras_dist as kd  # noqa: E402
from keras_dist import _keras  # noqa: E402
from keras_dist import callbacks as kd_callbacks  # noqa: E402
from keras_dist._keras.optimizer import DistributedOptimizer  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _init():
    kd.init()


class LearningRates(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.values = []

    def on_train_batch_begin(self, batch, logs=None):
        self.values.append(float(np.asarray(self.model.optimizer.learning_rate)))


def _fit(callbacks, optimizer=None, epochs=3, n=12, batch=4, **fit):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer or DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse")
    rates = LearningRates()
    history = model.fit(np.ones((n, 2)), np.ones((n, 1)), batch_size=batch, epochs=epochs,
                        verbose=0, callbacks=[*callbacks, rates], **fit)
    return rates.values, history


def test_warmup_at_size_one_is_the_initial_rate():
    rates, _ = _fit([kd_callbacks.LearningRateWarmupCallback(0.2, warmup_epochs=2)])
    np.testing.assert_allclose(rates, [0.2] * 9, rtol=1e-6)


def test_schedule_constant_factor_over_the_range_and_callable():
    rates, _ = _fit([kd_callbacks.LearningRateScheduleCallback(0.1, 0.1, start_epoch=1,
                                                              end_epoch=2)])
    np.testing.assert_allclose(rates, [0.1] * 3 + [0.01] * 3 + [0.01] * 3, rtol=1e-6)
    rates, _ = _fit([kd_callbacks.LearningRateScheduleCallback(
        1.0, lambda epoch: 1.0 / (1.0 + epoch), staircase=False)], epochs=2)
    expected = [1.0 / (1.0 + e + b / 3) for e in range(2) for b in range(3)]
    np.testing.assert_allclose(rates, expected, rtol=1e-6)


def test_schedule_multiplies_a_learning_rate_schedule():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5)
    optimizer = DistributedOptimizer(keras.optimizers.SGD(schedule))
    rates, _ = _fit([kd_callbacks.LearningRateScheduleCallback(0.0, 2.0)], optimizer, epochs=1)
    np.testing.assert_allclose(rates, [0.2 * 0.5**i for i in range(3)], rtol=1e-6)


# The two callbacks that take Horovod's `momentum_correction`.
LR_CALLBACKS = [
    lambda **kw: kd_callbacks.LearningRateWarmupCallback(0.1, 1, **kw),
    lambda **kw: kd_callbacks.LearningRateScheduleCallback(0.1, 0.5, **kw),
]


@pytest.mark.parametrize("make", LR_CALLBACKS, ids=["warmup", "schedule"])
def test_momentum_correction_asked_for_warns_once_that_it_has_no_effect(make):
    _keras._warned.discard("momentum_correction")
    with pytest.warns(UserWarning, match="momentum_correction has no effect") as caught:
        _fit([make(momentum_correction=True)],
             DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), epochs=1)
    assert sum("momentum_correction" in str(w.message) for w in caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        _fit([make(momentum_correction=True)],
             DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), epochs=1)


@pytest.mark.parametrize("make", LR_CALLBACKS, ids=["warmup", "schedule"])
@pytest.mark.parametrize("asked", [{}, {"momentum_correction": False},
                                   {"momentum_correction": None}], ids=["default", "false", "none"])
def test_momentum_correction_not_asked_for_is_silent(make, asked):
    _keras._warned.discard("momentum_correction")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _fit([make(**asked)], DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
             epochs=1)
    assert "momentum_correction" not in _keras._warned


def test_momentum_correction_without_momentum_is_silent():
    _keras._warned.discard("momentum_correction")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _fit([kd_callbacks.LearningRateWarmupCallback(0.1, 1, momentum_correction=True)],
             epochs=1)
    assert "momentum_correction" not in _keras._warned


def test_metric_average_and_broadcast_are_no_ops_at_size_one():
    _, plain = _fit([])
    _, history = _fit([kd_callbacks.BroadcastGlobalVariablesCallback(0),
                       kd_callbacks.MetricAverageCallback()])
    assert history.history == plain.history


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="warmup_epochs"):
        kd_callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=0)
    with pytest.raises(ValueError, match="end_epoch"):
        kd_callbacks.LearningRateScheduleCallback(0.1, 0.5, start_epoch=3, end_epoch=1)
    with pytest.raises(ValueError, match="root_rank"):
        _fit([kd_callbacks.BroadcastGlobalVariablesCallback(1)], epochs=1)
