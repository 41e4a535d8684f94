"""The TF1 session path in one process: DistributedOptimizer over tf.compat.v1.train
optimizers, BroadcastGlobalVariablesHook, and how TF1 graphs treat GPUs.

Eager execution stays on in this process (other tests need it): TF1 graphs
are built in ``tf.Graph().as_default()``, as in a session script.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_dist as kd  # noqa: E402
from keras_dist._keras.optimizer import DistributedOptimizer  # noqa: E402
from keras_dist._keras.tf1_optimizer import TF1DistributedOptimizer  # noqa: E402
from keras_dist.tensor import conversions  # noqa: E402
from keras_dist.tensor.tf import glue as tf_glue  # noqa: E402

v1 = tf.compat.v1


@pytest.fixture(scope="module", autouse=True)
def _init():
    kd.init()
    assert kd.size() == 1


def _model(seed):
    rng = np.random.default_rng(seed)
    x = v1.placeholder(tf.float64, [None, 3])
    w = v1.get_variable("w", initializer=rng.normal(size=(3, 2)))
    table = v1.get_variable("table", initializer=rng.normal(size=(5, 2)))
    loss = tf.reduce_mean((tf.matmul(x, w) + tf.gather(table, [0, 3, 3, 1])) ** 2)
    return x, (w, table), loss


def _batches(steps):
    rng = np.random.default_rng(7)
    return [rng.normal(size=(4, 3)) for _ in range(steps)]


def test_a_tf1_optimizer_is_wrapped_as_a_tf1_optimizer_that_delegates():
    with tf.Graph().as_default():
        _, (w, table), loss = _model(0)
        inner = v1.train.AdamOptimizer(0.1)
        wrapped = kd.DistributedOptimizer(inner)
        assert type(wrapped) is TF1DistributedOptimizer
        assert isinstance(wrapped, v1.train.Optimizer)
        assert not isinstance(wrapped, DistributedOptimizer)
        assert wrapped.inner_optimizer is inner
        assert wrapped.get_name() == "DistributedAdamOptimizer"
        assert kd.DistributedOptimizer(v1.train.AdamOptimizer(0.1), name="mine").get_name() \
            == "mine"
        wrapped.minimize(loss)
        assert wrapped.get_slot(w, "m") is inner.get_slot(w, "m") is not None
        assert wrapped.get_slot_names() == inner.get_slot_names() == ["m", "v"]
        assert wrapped.variables() == inner.variables() and wrapped.variables()


def test_a_keras_optimizer_still_gets_the_keras_wrapper():
    wrapped = kd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    assert isinstance(wrapped, DistributedOptimizer)
    assert isinstance(wrapped, keras.optimizers.Optimizer)


def _train(make_optimizer, hooks, steps=3):
    with tf.Graph().as_default():
        x, variables, loss = _model(0)
        global_step = v1.train.get_or_create_global_step()
        train = make_optimizer().minimize(loss, global_step=global_step)
        with v1.train.MonitoredTrainingSession(
                hooks=[*hooks, v1.train.StopAtStepHook(last_step=steps)],
                save_summaries_steps=None, save_summaries_secs=None,
                log_step_count_steps=None) as session:
            for batch in _batches(steps):
                _, values = session.run([train, variables[1]], {x: batch})
        return values


def test_size_one_trains_exactly_like_the_wrapped_optimizer():
    plain = _train(lambda: v1.train.AdamOptimizer(0.1), [])
    wrapped = _train(lambda: kd.DistributedOptimizer(v1.train.AdamOptimizer(0.1)),
                     [kd.BroadcastGlobalVariablesHook(0)])
    np.testing.assert_array_equal(plain, wrapped)


@pytest.mark.parametrize("average", [False, True])
def test_backward_passes_accumulate_eagerly_too(average):
    variable = tf.Variable(np.zeros(3))
    optimizer = kd.DistributedOptimizer(v1.train.GradientDescentOptimizer(1.0),
                                        backward_passes_per_step=3,
                                        average_aggregated_gradients=average)
    grads = np.random.default_rng(3).normal(size=(6, 3))
    expected = np.zeros(3)
    for step, grad in enumerate(grads):
        optimizer.minimize(lambda g=grad: tf.reduce_sum(variable * g), var_list=[variable])
        if step % 3 == 2:
            expected = expected - grads[step - 2:step + 1].sum(0) / (3 if average else 1)
        np.testing.assert_allclose(variable.numpy(), expected, rtol=1e-12)


def test_arguments_and_mixtures_are_refused_in_one_sentence():
    with tf.Graph().as_default():
        _, (w, _), loss = _model(0)
        wrapped = kd.DistributedOptimizer(v1.train.AdamOptimizer(0.1))
        with pytest.raises(ValueError, match="must not already be a DistributedOptimizer"):
            kd.DistributedOptimizer(wrapped)
        with pytest.raises(ValueError, match="`backward_passes_per_step` must be an integer"):
            kd.DistributedOptimizer(v1.train.AdamOptimizer(0.1), backward_passes_per_step=0)
        with pytest.raises(ValueError, match="do not go together"):
            kd.DistributedOptimizer(v1.train.AdamOptimizer(0.1), backward_passes_per_step=2,
                                    groups=2)
        accumulating = kd.DistributedOptimizer(v1.train.AdamOptimizer(0.1),
                                               backward_passes_per_step=2)
        grads = tf.gradients(loss, [w])
        with pytest.raises(ValueError, match="takes the gradients this optimizer's"):
            accumulating.apply_gradients(zip(grads, [w]))
        with pytest.raises(TypeError, match="loss_scale"):
            kd.DistributedOptimizer(v1.train.AdamOptimizer(0.1), loss_scale=True)
        with pytest.raises(ValueError, match="must be a Keras 3 optimizer"):
            kd.PartialDistributedOptimizer(v1.train.AdamOptimizer(0.1))
        with pytest.raises(ValueError, match=r"^DistributedOptimizer\(SGD\) needs TensorFlow to "
                                             r"run eagerly \(Keras 3 does not train a model in "
                                             r"TF1 graph mode\).*Received: a TF1 graph"):
            kd.DistributedOptimizer(keras.optimizers.SGD(0.1))
        for callback in (kd.callbacks.BroadcastGlobalVariablesCallback(0),
                         kd.callbacks.MetricAverageCallback(),
                         kd.callbacks.LearningRateWarmupCallback(0.1)):
            # Keras 3's fit would fail deep in its trainer: the callbacks say why first.
            with pytest.raises(ValueError, match=f"^{type(callback).__name__} needs "
                                                 "TensorFlow to run eagerly"):
                callback.on_train_begin()
        layer = keras.layers.Dense(2)
        keras_loss = tf.reduce_sum(layer(v1.placeholder(tf.float32, [None, 3])))
        with pytest.raises(ValueError, match="not Keras 3 variables"):
            wrapped.minimize(keras_loss, var_list=layer.trainable_variables)


def test_the_hook_checks_its_arguments_and_builds_once_per_graph():
    with pytest.raises(ValueError, match=r"^`root_rank` must be in \[0, size\)\. "
                                         r"Received: root_rank=1 \(size=1\)$"):
        kd.BroadcastGlobalVariablesHook(1)
    with pytest.raises(ValueError, match="`root_rank` must be an integer"):
        kd.BroadcastGlobalVariablesHook("0")
    with pytest.raises(ValueError, match="`device` must be a TensorFlow device string"):
        kd.BroadcastGlobalVariablesHook(0, device=None)
    hook = kd.BroadcastGlobalVariablesHook(0, device="/CPU:0")
    with pytest.raises(RuntimeError, match="TF1 graph mode only"):
        hook.begin()  # eager: no global variables
    with tf.Graph().as_default():
        v1.get_variable("v", initializer=np.ones(2))
        hook.begin()
        first = hook.broadcast_op
        hook.begin()
        assert hook.broadcast_op is first
    with tf.Graph().as_default():
        hook.begin()
        assert hook.broadcast_op is not first


def test_a_tf1_graph_keeps_collectives_on_the_host_and_numbers_gpus_as_sessions(monkeypatch):
    numbered = []

    def gpu_visible():
        raise AssertionError("a TF1 graph asked TensorFlow's eager runtime for its GPUs")

    monkeypatch.setattr(tf_glue, "gpu_visible", gpu_visible)
    monkeypatch.setattr(tf_glue, "number_gpus_as_sessions",
                        lambda rank, size: numbered.append((rank, size)))
    with tf.Graph().as_default() as graph:
        kd.allreduce(tf.constant([1.0, 2.0]))
        assert "EagerPyFunc" not in {op.type for op in graph.get_operations()}
        assert not conversions._tf_device_path_available()
    assert numbered == [(0, 1)]
    monkeypatch.undo()
    tf.function(lambda x: kd.allreduce(x)).get_concrete_function(tf.constant([1.0]))
    assert numbered == [(0, 1)]  # a tf.function of an eager program: unchanged


class _FakeGpus:
    """TensorFlow's device configuration with ``count`` GPUs, none started."""

    def __init__(self, count, visible=None, started=False):
        self.physical = [f"GPU:{i}" for i in range(count)]
        self.visible = list(self.physical if visible is None else visible)
        self.started, self.set_to = started, []

    def install(self, monkeypatch):
        monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind: self.physical)
        monkeypatch.setattr(tf.config, "get_visible_devices", lambda kind: self.visible)
        monkeypatch.setattr(tf.config, "set_visible_devices", self.set_visible)

    def set_visible(self, devices, kind):
        if self.started:
            raise RuntimeError("Visible devices cannot be modified after being initialized")
        self.set_to.append(devices)


@pytest.mark.parametrize("gpus,rank,size,expected", [
    (4, 1, 4, ["GPU:1"]),  # Horovod's recipe: the GPU at the local rank
    (2, 0, 2, ["GPU:0"]),
    (4, 0, 1, []),  # one rank on the machine: it may use every GPU
    (1, 1, 2, []),  # fewer GPUs than ranks (kdrun --gpu-per-rank: one each)
    (0, 1, 2, []),
])
def test_the_eager_runtime_sees_the_rank_gpu_when_several_ranks_share_a_machine(
        monkeypatch, gpus, rank, size, expected):
    fake = _FakeGpus(gpus)
    fake.install(monkeypatch)
    tf_glue.number_gpus_as_sessions(rank, size)
    assert fake.set_to == expected


def test_gpus_the_user_chose_or_a_started_runtime_stay_as_they_are(monkeypatch):
    chosen = _FakeGpus(4, visible=["GPU:2"])
    chosen.install(monkeypatch)
    tf_glue.number_gpus_as_sessions(1, 4)
    assert chosen.set_to == []
    started = _FakeGpus(4, started=True)
    started.install(monkeypatch)
    tf_glue.number_gpus_as_sessions(1, 4)  # no error: its numbering stands
    assert started.set_to == []


def test_a_keras_model_compiled_with_a_tf1_optimizer_is_told_what_to_use():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=r"a Keras 3 model compiles with a Keras 3 optimizer, "
                                         r"e\.g\. kd\.DistributedOptimizer\(keras\.optimizers"):
        model.compile(optimizer=kd.DistributedOptimizer(v1.train.AdamOptimizer(0.1)), loss="mse")
