"""Every function of keras_dist._compat (the private Keras/TF APIs) on the installed Keras.

CI runs this file on the newest Keras and again on the oldest supported one
(``.ci/run``), so a Keras release that moves one of these APIs fails here,
by name, rather than somewhere inside ``fit``.
"""

import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_dist as kd  # noqa: E402
from keras_dist import _compat as compat  # noqa: E402
from keras_dist._keras.optimizer import DistributedOptimizer  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _init():
    kd.init()


class _Holder(keras.layers.Layer):
    def tracked(self):
        self.kept = keras.Variable(np.ones(2, np.float32), name="kept")

    @compat.no_automatic_dependency_tracking
    def untracked(self):
        self.hidden = keras.Variable(np.ones(3, np.float32), name="hidden")


def test_no_automatic_dependency_tracking_keeps_attributes_out_of_the_weights():
    layer = _Holder()
    layer.tracked()
    layer.untracked()
    names = [w.name for w in layer.weights]
    assert "kept" in names  # the control: Keras tracks what is set without the decorator
    assert "hidden" not in names, names
    assert layer.hidden.shape == (3,)


def test_print_msg_prints_through_keras(capsys):
    was_interactive = keras.config.is_interactive_logging_enabled()
    keras.config.enable_interactive_logging()
    try:
        compat.print_msg("keras_dist compat message")
    finally:
        if not was_interactive:
            keras.config.disable_interactive_logging()
    assert "keras_dist compat message" in capsys.readouterr().out


def test_learning_rate_attribute_reads_and_replaces_the_stored_rate():
    optimizer = keras.optimizers.SGD(0.25)
    stored = compat.learning_rate_attribute(optimizer)
    assert isinstance(stored, keras.Variable)
    assert float(keras.ops.convert_to_numpy(stored)) == 0.25
    schedule = keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.5)
    compat.set_learning_rate_attribute(optimizer, schedule)
    assert compat.learning_rate_attribute(optimizer) is schedule
    # The optimizer's public learning rate now evaluates the schedule at its step (0).
    assert float(keras.ops.convert_to_numpy(optimizer.learning_rate)) == pytest.approx(0.5)


def test_built_variables_and_their_index_follow_build_order():
    variables = [keras.Variable(np.zeros(n, np.float32), name=f"v{n}") for n in (1, 2, 3)]
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(variables)
    built = compat.built_variables(optimizer)
    assert [v.name for v in built] == ["v1", "v2", "v3"]
    assert [compat.variable_index(optimizer, v) for v in reversed(variables)] == [2, 1, 0]


def test_loss_scale_apply_applies_finite_gradients_and_skips_the_others():
    variable = keras.Variable(np.ones(3, np.float32))
    optimizer = DistributedOptimizer(keras.optimizers.SGD(0.5), loss_scale=True,
                                     initial_scale=8.0)
    optimizer.build([variable])
    # Gradients of the scaled loss: the step unscales them by 8.
    compat.loss_scale_apply(optimizer, [keras.ops.full((3,), 8.0)], [variable])
    np.testing.assert_allclose(keras.ops.convert_to_numpy(variable), [0.5] * 3)
    assert float(keras.ops.convert_to_numpy(optimizer.dynamic_scale)) == 8.0
    compat.loss_scale_apply(optimizer, [keras.ops.convert_to_tensor([np.inf, 1.0, 1.0])],
                            [variable])
    np.testing.assert_allclose(keras.ops.convert_to_numpy(variable), [0.5] * 3)
    assert float(keras.ops.convert_to_numpy(optimizer.dynamic_scale)) == 4.0


def test_initial_epoch_is_what_fit_starts_at():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    assert compat.initial_epoch(model) is None
    compat.set_initial_epoch(model, 2)
    assert compat.initial_epoch(model) == 2
    history = model.fit(np.ones((4, 2)), np.ones((4, 1)), epochs=4, verbose=0)
    assert history.epoch == [2, 3]


def test_backup_weights_path_is_the_file_backup_and_restore_writes(tmp_path):
    callback = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    path = compat.backup_weights_path(callback)
    assert not compat.file_exists(path)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "backup"),
                                                          delete_checkpoint=False)])
    assert compat.file_exists(path)
    assert path == str(tmp_path / "backup" / "latest.weights.h5")


def test_in_xla_context_is_true_only_while_xla_traces():
    seen = {}

    def probe(label):
        seen[label] = compat.in_xla_context()
        return tf.constant(0.0)

    probe("eager")
    tf.function(lambda: probe("graph"))()
    tf.function(lambda: probe("xla"), jit_compile=True)()
    assert seen == {"eager": False, "graph": False, "xla": True}


def test_importing_compat_loads_no_framework():
    import subprocess
    import sys

    code = ("import sys, keras_dist._compat\n"
            "loaded = [m for m in ('keras', 'tensorflow', 'jax', 'torch') if m in sys.modules]\n"
            "assert not loaded, loaded\n"
            "print('LIGHT')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert "LIGHT" in result.stdout, result.stdout + result.stderr


def test_tensorflow_private_apis_answer():
    import tensorflow as tf

    assert compat.tape_may_record() is False  # no tape is open here
    with tf.GradientTape():
        assert compat.tape_may_record() is True
    traced = []
    tf.function(lambda: traced.append(tf.compat.v1.get_default_graph()) or 0)()
    assert isinstance(traced[0], compat.func_graph_class())


def test_auto_jit_compile_resolution_takes_a_veto(monkeypatch):
    def veto(model):
        return "keras_dist test veto" if getattr(model, "veto_auto_jit", False) else None

    compat.turn_off_auto_jit_compile_when(veto)
    vetoed = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    vetoed.veto_auto_jit = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # where Keras would not use XLA: nothing to say
        assert vetoed._resolve_auto_jit_compile() is False  # Keras's own answer on a CPU
    gpu = tf.config.PhysicalDevice(name="/physical_device:GPU:0", device_type="GPU")
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda *args: [gpu])
    with pytest.warns(UserWarning, match="keras_dist test veto") as caught:
        assert vetoed._resolve_auto_jit_compile() is False
    assert caught[0].filename == __file__  # the caller's line
    other = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert other._resolve_auto_jit_compile() is True  # Keras's own answer with a GPU


def test_control_flow_context_is_none_only_at_a_tf1_graphs_top_level():
    import tensorflow as tf

    seen = []

    def branch():
        seen.append(compat.control_flow_context(tf.compat.v1.get_default_graph()))
        return tf.constant(1.0)

    tf.compat.v1.disable_control_flow_v2()  # a TF1 graph's own tf.cond
    try:
        with tf.Graph().as_default() as graph:
            assert compat.control_flow_context(graph) is None
            tf.compat.v1.cond(tf.constant(True), branch, branch)
    finally:
        tf.compat.v1.enable_control_flow_v2()
    assert seen and all(context is not None for context in seen), seen


def test_jax_trace_is_shared_by_the_tracers_of_one_function():
    jax = pytest.importorskip("jax", reason="needs jax (the test extra installs it)")

    traces = []

    def step(x, y):
        traces.append((compat.jax_trace(x), compat.jax_trace(y), compat.jax_trace(x + y)))
        return x

    jax.jit(step)(jax.numpy.ones(2), jax.numpy.zeros(2))
    (first, second, derived), = traces
    assert first is not None and first is second is derived
    assert compat.jax_trace(jax.numpy.ones(2)) is None
    assert compat.jax_trace(np.ones(2)) is None
