"""DistributedOptimizer in one process: at size 1 it is the wrapped optimizer."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_dist as kd  # noqa: E402
from keras_dist import ops as kd_ops  # noqa: E402
from keras_dist._keras.optimizer import DistributedOptimizer  # noqa: E402
from keras_dist._keras.saving import load_model  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _init():
    kd.init()
    assert kd.size() == 1


@pytest.fixture(autouse=True)
def _float32_policy():
    yield
    keras.config.set_dtype_policy("float32")


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
                             keras.layers.Dense(1)])


def _data(n=32):
    rng = np.random.default_rng(1)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def test_size_one_trains_exactly_like_the_wrapped_optimizer_without_collectives():
    x, y = _data()
    plain = _model()
    plain.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
    plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    wrapped = _model()
    wrapped.compile(DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), "mse")
    before = dict(kd_ops.COUNTERS)
    wrapped.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert dict(kd_ops.COUNTERS) == before
    for a, b in zip(plain.get_weights(), wrapped.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(wrapped.optimizer.iterations) == 8


@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("in_function", [False, True])
def test_backward_passes_accumulate_locally(average, in_function):
    var = keras.Variable(np.zeros(3, "float32"))
    opt = DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=3,
                               average_aggregated_gradients=average)
    grads = [np.array([1.0, 2.0, 3.0], "float32") * (i + 1) for i in range(6)]
    def step(grad):
        opt.apply([grad], [var])

    if in_function:
        step = tf.function(step)
    expected = np.zeros(3)
    for i, grad in enumerate(grads):
        step(tf.constant(grad))
        if i % 3 == 2:
            total = sum(g.astype(np.float64) for g in grads[i - 2:i + 1])
            expected -= total / 3 if average else total
        np.testing.assert_allclose(var.numpy(), expected, rtol=1e-6)
    assert int(opt.iterations) == 2


def test_none_gradients_are_skipped():
    a, b = keras.Variable(np.ones(2, "float32")), keras.Variable(np.ones(2, "float32"))
    opt = DistributedOptimizer(keras.optimizers.SGD(0.5))
    with pytest.warns(UserWarning, match="Gradients do not exist"):
        opt.apply([tf.constant([1.0, 1.0]), None], [a, b])
    np.testing.assert_array_equal(a.numpy(), [0.5, 0.5])
    np.testing.assert_array_equal(b.numpy(), [1.0, 1.0])


def test_embedding_gradients_train_at_size_one():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(10, 2),
                              keras.layers.Flatten(), keras.layers.Dense(1)])
    model.compile(DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse")
    x = np.random.default_rng(0).integers(0, 10, size=(16, 3))
    history = model.fit(x, np.ones((16, 1)), epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_arguments_are_checked():
    sgd = keras.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        DistributedOptimizer(sgd, backward_passes_per_step=0)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        DistributedOptimizer(sgd, op=kd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="compression"):
        DistributedOptimizer(sgd, compression="fp16")
    with pytest.raises(ValueError, match="keras.optimizers.Optimizer"):
        DistributedOptimizer("sgd")
    with pytest.raises(ValueError, match="already"):
        DistributedOptimizer(DistributedOptimizer(sgd))


def test_config_round_trip():
    opt = DistributedOptimizer(keras.optimizers.Adam(0.01), op=kd.Sum,
                               compression=kd.Compression.fp16, backward_passes_per_step=2,
                               sparse_as_dense=True)
    clone = DistributedOptimizer.from_config(opt.get_config())
    assert clone.op is kd.Sum and clone.compression is kd.Compression.fp16
    assert clone.backward_passes_per_step == 2 and clone.sparse_as_dense
    assert isinstance(clone.inner_optimizer, keras.optimizers.Adam)
    assert float(clone.learning_rate) == pytest.approx(0.01)


@pytest.mark.parametrize("passes", [1, 2])
def test_saved_model_resumes_with_the_inner_state(tmp_path, passes):
    x, y = _data()
    model = _model()
    model.compile(DistributedOptimizer(keras.optimizers.Adam(0.01),
                                       backward_passes_per_step=passes), "mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    restored = load_model(path)
    assert isinstance(restored.optimizer, DistributedOptimizer)
    assert isinstance(restored.optimizer.inner_optimizer, keras.optimizers.Adam)
    for a, b in zip(model.optimizer.variables, restored.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    restored.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), restored.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_mixed_float16_scales_the_loss_itself_and_compile_does_not_wrap():
    keras.config.set_dtype_policy("mixed_float16")
    model = _model()
    opt = DistributedOptimizer(keras.optimizers.SGD(0.1))
    model.compile(opt, "mse")
    assert model.optimizer is opt
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert opt.loss_scale
    assert float(opt.dynamic_scale) == 2.0**15
    weights = [w.numpy() for w in model.trainable_weights]
    grads = [tf.fill(w.shape, np.inf) for w in weights]
    opt.apply(grads, model.trainable_weights)
    assert float(opt.dynamic_scale) == 2.0**14
    for w, v in zip(weights, model.trainable_weights):
        np.testing.assert_array_equal(w, v.numpy())


def test_a_loss_scale_optimizer_is_taken_over():
    inner = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0)
    opt = DistributedOptimizer(inner)
    assert opt.loss_scale and opt.initial_scale == 8.0
    assert isinstance(opt.inner_optimizer, keras.optimizers.SGD)


def test_xla_stays_on_at_size_one():
    x, y = _data()
    model = _model()
    model.compile(DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse", jit_compile=True)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.jit_compile
