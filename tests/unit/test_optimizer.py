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
    # Every backward pass counts, as with Keras's gradient_accumulation_steps.
    assert int(opt.iterations) == 6
    assert int(opt.local_steps) == 0


def _fit(optimizer, epochs=1):
    x, y = _data(48)
    model = _model()
    model.compile(optimizer, "mse")
    model.fit(x, y, batch_size=4, epochs=epochs, shuffle=False, verbose=0)
    return model


def _schedule():
    return keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.9)


@pytest.mark.parametrize("how", ["backward_passes", "keras_accumulation"])
def test_accumulation_matches_keras_gradient_accumulation(how):
    """Same weights (to float32 rounding) and step count as Keras's own
    accumulation, a learning-rate schedule included."""
    reference = _fit(keras.optimizers.SGD(_schedule(), momentum=0.5,
                                          gradient_accumulation_steps=3))
    if how == "backward_passes":
        opt = DistributedOptimizer(keras.optimizers.SGD(_schedule(), momentum=0.5),
                                   backward_passes_per_step=3,
                                   average_aggregated_gradients=True)
    else:
        inner = keras.optimizers.SGD(_schedule(), momentum=0.5, gradient_accumulation_steps=3)
        opt = DistributedOptimizer(inner)
        assert inner.gradient_accumulation_steps is None
        assert opt.backward_passes_per_step == 3 and opt.average_aggregated_gradients
    model = _fit(opt)
    # Keras's `iterations` counts updates there; its schedule reads the passes.
    assert int(opt.iterations) == int(reference.optimizer._iterations) == 12
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_keras_accumulation_and_other_backward_passes_conflict():
    inner = keras.optimizers.SGD(0.1, gradient_accumulation_steps=3)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        DistributedOptimizer(inner, backward_passes_per_step=2)
    assert inner.gradient_accumulation_steps == 3


@pytest.mark.parametrize("passes", [1, 2])
def test_compute_gradients_then_apply_gradients(passes):
    """Horovod's Keras 2 path: reduced (and accumulated) gradients, applied once."""
    var = tf.Variable([1.0, -2.0])
    opt = DistributedOptimizer(keras.optimizers.SGD(0.5), backward_passes_per_step=passes)
    expected = np.array([1.0, -2.0])
    for step in range(4):
        pairs = opt._compute_gradients(lambda: tf.reduce_sum(var * var), var_list=[var])
        grad = 2.0 * expected
        returned = np.asarray(pairs[0][0])
        if passes == 2 and step % 2 == 0:
            np.testing.assert_allclose(returned, grad)  # the running sum so far
        opt.apply_gradients(pairs)
        if passes == 1:
            expected = expected - 0.5 * grad
        elif step % 2 == 0:
            first = grad
        else:
            expected = expected - 0.5 * (first + grad)
        np.testing.assert_allclose(var.numpy(), expected, rtol=1e-6)
    assert int(opt.iterations) == 4


def test_get_gradients_uses_the_wrapped_optimizers():
    class Fixed(keras.optimizers.SGD):
        def get_gradients(self, loss, params):
            return [tf.constant([3.0]) for _ in params]

    var = tf.Variable([0.0])
    opt = DistributedOptimizer(Fixed(1.0))
    (grad,) = opt.get_gradients(None, [var])
    opt.apply_gradients([(grad, var)])
    np.testing.assert_array_equal(var.numpy(), [-3.0])
    with pytest.raises(AttributeError, match="get_gradients"):
        DistributedOptimizer(keras.optimizers.SGD(1.0)).get_gradients(None, [var])


def test_local_variables_and_layers_at_size_one():
    model = _model()
    opt = kd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1),
                                         local_layers=model.layers[0])
    opt.register_local_var(model.layers[1].kernel)
    plain = _model()
    plain.compile(keras.optimizers.SGD(0.1), "mse")
    model.compile(opt, "mse")
    x, y = _data()
    for m in (plain, model):
        m.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="local_layers"):
        kd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=["dense"])


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
    with pytest.raises(ValueError, match="`groups`"):
        DistributedOptimizer(sgd, groups=0)
    with pytest.raises(ValueError, match="`num_groups`"):
        DistributedOptimizer(sgd, num_groups=-1)
    with pytest.raises(ValueError, match="already"):
        DistributedOptimizer(DistributedOptimizer(sgd))


def test_config_round_trip():
    opt = DistributedOptimizer(keras.optimizers.Adam(0.01), op=kd.Sum,
                               compression=kd.Compression.fp16, backward_passes_per_step=2,
                               sparse_as_dense=True, groups=3, scale_local_gradients=False)
    clone = DistributedOptimizer.from_config(opt.get_config())
    assert clone.get_config() == opt.get_config()
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


def test_load_model_takes_custom_optimizers_as_horovod(tmp_path):
    class HalfStepSGD(keras.optimizers.SGD):
        """An SGD the file names by class; Keras cannot find it by itself."""

    model = _model()
    model.compile(DistributedOptimizer(HalfStepSGD(0.05)), "mse")
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    path = tmp_path / "custom.keras"
    model.save(path)
    with pytest.raises(TypeError, match="HalfStepSGD"):
        load_model(path)
    restored = load_model(path, custom_optimizers=[HalfStepSGD])
    assert type(restored.optimizer.inner_optimizer).__name__ == "HalfStepSGD"
    for a, b in zip(model.get_weights(), restored.get_weights()):
        np.testing.assert_array_equal(a, b)


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


def test_a_cpu_fit_gives_no_xla_notice(monkeypatch):
    # Keras never compiles with XLA where TensorFlow sees no GPU, so turning it
    # off changes nothing there: no notice, even when the optimizer reduces.
    import warnings

    monkeypatch.setattr(DistributedOptimizer, "_reduces", lambda self: True)
    x, y = _data()
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile(optimizer=kd.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                      loss="mse", metrics=["mae"])
        model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                  callbacks=[kd.callbacks.BroadcastGlobalVariablesCallback(0)])
    ours = [str(w.message) for w in caught if "keras_dist" in str(w.message)]
    assert not ours, ours
    assert model.jit_compile is False
