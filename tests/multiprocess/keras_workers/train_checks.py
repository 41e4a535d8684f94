"""The Keras layer on N ranks: every check runs on every rank, on the Keras
backend of ``KERAS_BACKEND`` (TensorFlow, JAX or PyTorch).

References are numpy float64 computations each rank does on its own from the
same seeded data. Prints "KERAS CHECKS OK rank=R size=N" at the end; any
failure raises, and kdrun stops the job. Checks of TensorFlow-only features
(``tf.function`` steps, ``IndexedSlices``) print why they are left out on the
other backends.
"""

import os
import tempfile
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from tests._threads import one_thread_per_rank  # noqa: E402

BACKEND = os.environ.get("KERAS_BACKEND", "tensorflow")
one_thread_per_rank()
if BACKEND == "tensorflow":
    import tensorflow as tf

import keras  # noqa: E402

import keras_dist as kd  # noqa: E402
from keras_dist import callbacks as kd_callbacks  # noqa: E402
from keras_dist import ops as kd_ops  # noqa: E402
from keras_dist._keras.optimizer import DistributedOptimizer  # noqa: E402
from keras_dist._keras.saving import load_model  # noqa: E402
from keras_dist.data import shard  # noqa: E402
from tests.multiprocess.workers._checks import run_checks  # noqa: E402

kd.init()
RANK, SIZE = kd.rank(), kd.size()
LOCAL_BATCH, STEPS, EPOCHS, LR = 4, 3, 2, 0.1


def mlp(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


def data(n, seed=42):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 5)), rng.normal(size=(n, 1))


def reference_grads(weights, x, y):
    w1, b1, w2, b2 = weights
    h = np.tanh(x @ w1 + b1)
    d = 2.0 * (h @ w2 + b2 - y) / y.size
    dh = (d @ w2.T) * (1.0 - h**2)
    return [x.T @ dh, dh.sum(0), h.T @ d, d.sum(0)]


def reference_sgd(weights, x, y, global_batch, epochs, passes=1):
    weights = [np.asarray(w, np.float64) for w in weights]
    batches = [(x[i:i + global_batch], y[i:i + global_batch])
               for i in range(0, len(x), global_batch)]
    for _ in range(epochs):
        for start in range(0, len(batches), passes):
            group = batches[start:start + passes]
            total = [sum(g) for g in zip(*(reference_grads(weights, bx, by) for bx, by in group))]
            weights = [w - LR * g for w, g in zip(weights, total)]
    return weights


def same_on_every_rank(arrays, what):
    blobs = kd.allgather_object([np.asarray(a).tobytes() for a in arrays])
    for rank, blob in enumerate(blobs):
        assert blob == blobs[0], f"{what}: rank {rank} differs from rank 0"


def close(actual, expected, what, rtol=2e-5, atol=2e-6):
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(np.asarray(a, np.float64), e, rtol=rtol, atol=atol,
                                   err_msg=what)


class Recorder(keras.callbacks.Callback):
    """Keeps what later callbacks see: logs, learning rates, start state."""

    def __init__(self):
        super().__init__()
        self.epoch_logs, self.batch_lrs, self.start_state = [], [], None

    def on_train_batch_begin(self, batch, logs=None):
        if self.start_state is None:
            self.start_state = [np.array(v) for v in
                                self.model.weights + self.model.optimizer.variables]
        self.batch_lrs.append(float(np.asarray(self.model.optimizer.learning_rate)))

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(dict(logs))


def check_exactness_and_collective_count():
    """N ranks at batch b from different weights == one rank at batch N*b."""
    x, y = data(SIZE * LOCAL_BATCH * STEPS)
    root_start = mlp(1000).get_weights()
    model = mlp(1000 + RANK)
    starts = kd.allgather_object(model.get_weights()[0].tobytes())
    assert len(set(starts)) == SIZE, "ranks should start from different weights"
    model.compile(DistributedOptimizer(keras.optimizers.SGD(LR)), "mse")
    x_local, y_local = shard((x.astype("float32"), y.astype("float32")), batch_size=LOCAL_BATCH)
    before = kd_ops.COUNTERS["allreduce"]
    model.fit(x_local, y_local, batch_size=LOCAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[kd_callbacks.BroadcastGlobalVariablesCallback(0)])
    expected_calls = 0 if SIZE == 1 else EPOCHS * STEPS
    assert kd_ops.COUNTERS["allreduce"] - before == expected_calls, kd_ops.COUNTERS
    close(model.get_weights(),
          reference_sgd(root_start, x, y, SIZE * LOCAL_BATCH, EPOCHS), "exactness")
    same_on_every_rank(model.get_weights(), "exactness weights")


def check_backward_passes():
    """k local passes summed, one allreduce every k steps."""
    passes = 3
    x, y = data(SIZE * LOCAL_BATCH * STEPS * 2, seed=7)
    root_start = mlp(5).get_weights()
    model = mlp(5)
    model.compile(DistributedOptimizer(keras.optimizers.SGD(LR),
                                       backward_passes_per_step=passes), "mse")
    x_local, y_local = shard((x.astype("float32"), y.astype("float32")), batch_size=LOCAL_BATCH)
    before = kd_ops.COUNTERS["allreduce"]
    model.fit(x_local, y_local, batch_size=LOCAL_BATCH, epochs=1, shuffle=False, verbose=0)
    steps = STEPS * 2
    assert kd_ops.COUNTERS["allreduce"] - before == (0 if SIZE == 1 else steps // passes)
    assert int(model.optimizer.iterations) == steps  # every backward pass counts
    close(model.get_weights(),
          reference_sgd(root_start, x, y, SIZE * LOCAL_BATCH, 1, passes), "backward passes")
    same_on_every_rank(model.get_weights(), "backward-pass weights")


def _applier(optimizer, variables):
    def apply(*grads):
        optimizer.apply(list(grads), variables)

    return apply


def _sparse_step(optimizer, embedding):
    def step(rows):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(embedding.value, rows))
        grad = tape.gradient(loss, embedding.value)
        assert isinstance(grad, tf.IndexedSlices)
        optimizer.apply([grad], [embedding])

    return step


def check_options_on_one_step():
    """fp16 compression, predivide factor, Sum and sparse gradients, one step each."""
    rng = np.random.default_rng(3)
    grads = [rng.normal(size=(SIZE, 6, 3)), rng.normal(size=(SIZE, 3))]
    mean = [g.mean(0) for g in grads]
    cases = [
        (dict(), mean, 1e-6),
        (dict(compression=kd.Compression.fp16), mean, 2e-3),
        (dict(gradient_predivide_factor=float(SIZE) + 1.0), mean, 1e-6),
        (dict(op=kd.Sum), [g.sum(0) for g in grads], 1e-6),
    ]
    for options, expected, tol in cases:
        variables = [keras.Variable(np.zeros(g.shape[1:], "float32")) for g in grads]
        opt = DistributedOptimizer(keras.optimizers.SGD(1.0), **options)
        if BACKEND == "tensorflow":  # inside a traced step
            step = tf.function(_applier(opt, variables))
            step(*[tf.constant(g[RANK], tf.float32) for g in grads])
        else:  # eagerly, with the backend's tensors
            opt.apply([keras.ops.convert_to_tensor(g[RANK], "float32") for g in grads],
                      variables)
        values = [np.asarray(keras.ops.convert_to_numpy(v)) for v in variables]
        close(values, [-e for e in expected], str(options), tol, tol)
        same_on_every_rank(values, str(options))

    if BACKEND != "tensorflow":
        print(f"sparse gradients: left out on {BACKEND} (IndexedSlices are TensorFlow's)")
        return

    table = rng.normal(size=(10, 2))
    ids = rng.integers(0, 10, size=(SIZE, 4))
    for dense in (False, True):
        embedding = keras.Variable(table.astype("float32"))
        opt = DistributedOptimizer(keras.optimizers.SGD(1.0), sparse_as_dense=dense)

        tf.function(_sparse_step(opt, embedding))(tf.constant(ids[RANK]))
        expected = table.copy()
        for row in ids.reshape(-1):
            expected[row] -= 1.0 / SIZE
        close([embedding.numpy()], [expected], f"sparse_as_dense={dense}", 1e-6, 1e-6)
        same_on_every_rank([embedding.numpy()], f"sparse_as_dense={dense}")


def check_callbacks():
    """Broadcast of all state, metric averaging, warmup schedule batch by batch."""
    keras.utils.set_random_seed(100 + RANK)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4),
                              keras.layers.BatchNormalization(), keras.layers.Dense(1)])
    model.compile(DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.5)), "mse",
                  metrics=["mae"])
    model.optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(RANK)
    state = model.weights + model.optimizer.variables
    for variable in state:
        if "float" in str(variable.dtype) and "learning_rate" not in variable.path:
            variable.assign(rng.uniform(0.1, 1.0, size=variable.shape).astype(variable.dtype))
    root_state = kd.broadcast_object([np.array(v) for v in state], root_rank=0)
    compared = ["learning_rate" not in v.path for v in state]

    x, y = data(SIZE * 8 * 4, seed=11)
    xv, yv = data(SIZE * 6, seed=12)
    x_local, y_local = shard((x.astype("float32"), y.astype("float32")), batch_size=8)
    raw, seen = Recorder(), Recorder()
    initial_lr, warmup = 0.05, 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(
            x_local, y_local, batch_size=8, epochs=3, shuffle=False, verbose=0,
            validation_data=shard((xv.astype("float32"), yv.astype("float32"))),
            callbacks=[kd_callbacks.BroadcastGlobalVariablesCallback(0), raw,
                       kd_callbacks.MetricAverageCallback(),
                       kd_callbacks.LearningRateWarmupCallback(initial_lr, warmup, verbose=1),
                       seen])
    # A momentum optimizer, momentum_correction not asked for: no warning.
    assert not any("momentum_correction" in str(w.message) for w in caught), \
        [str(w.message) for w in caught]
    for actual, expected, path, keep in zip(seen.start_state, root_state,
                                            [v.path for v in state], compared):
        if keep:
            np.testing.assert_array_equal(actual, expected, err_msg=f"{path} after broadcast")

    every_rank = kd.allgather_object(raw.epoch_logs)
    for epoch, averaged in enumerate(seen.epoch_logs):
        assert {"loss", "mae", "val_loss", "val_mae"} <= set(averaged), averaged
        for key, value in averaged.items():
            if key == "learning_rate":
                continue
            mean = np.mean([logs[epoch][key] for logs in every_rank])
            assert abs(value - mean) <= 1e-6 * max(1.0, abs(mean)), (key, value, mean)
            assert history.history[key][epoch] == value, key

    steps = 4
    expected_lrs = [
        initial_lr / SIZE * (1 + (SIZE - 1) * (e + (b + 1) / steps) / warmup)
        if e < warmup else initial_lr
        for e in range(3) for b in range(steps)
    ]
    np.testing.assert_allclose(seen.batch_lrs, expected_lrs, rtol=1e-6)
    # BatchNormalization statistics follow each rank's own batches, as in Horovod.
    same_on_every_rank([np.asarray(w) for w in model.trainable_weights],
                       "callback-trained weights")


def check_schedule_callback():
    """Constant multiplier over [start, end); callable gets the fractional epoch."""
    model = mlp(3)
    model.compile(DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse")
    x, y = data(SIZE * 4 * 2, seed=13)
    x_local, y_local = shard((x.astype("float32"), y.astype("float32")), batch_size=4)
    seen = Recorder()
    model.fit(x_local, y_local, batch_size=4, epochs=4, shuffle=False, verbose=0,
              callbacks=[kd_callbacks.LearningRateScheduleCallback(0.1, 0.5, start_epoch=1,
                                                                  end_epoch=3),
                         kd_callbacks.LearningRateScheduleCallback(
                             0.1, lambda e: 1.0 + e, start_epoch=3, staircase=False,
                             momentum_correction=False),
                         seen])
    expected = [0.1, 0.1, 0.05, 0.05, 0.05, 0.05, 0.1 * 4.0, 0.1 * 4.5]
    np.testing.assert_allclose(seen.batch_lrs, expected, rtol=1e-6)

    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5)
    model = mlp(3)
    model.compile(DistributedOptimizer(keras.optimizers.SGD(schedule)), "mse")
    seen = Recorder()
    model.fit(x_local, y_local, batch_size=4, epochs=2, shuffle=False, verbose=0,
              callbacks=[kd_callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=1), seen])
    expected = [0.1 * 0.5**i * (1 + (SIZE - 1) * (i + 1) / 2) / SIZE for i in range(2)]
    expected += [0.1 * 0.5**i for i in (2, 3)]
    np.testing.assert_allclose(seen.batch_lrs, expected, rtol=1e-5)


def check_mixed_precision_overflow_on_one_rank():
    """All ranks skip a step together when only the last rank overflows."""
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = mlp(9)
        opt = DistributedOptimizer(keras.optimizers.SGD(0.01), initial_scale=4.0)
        model.compile(opt, "mse")
        x, y = data(SIZE * 4 * 3, seed=14)
        x_local, y_local = shard((x.astype("float32"), y.astype("float32")), batch_size=4)
        if RANK == SIZE - 1:
            x_local[4:8] = np.inf  # non-finite gradients in the second step, on one rank only
        model.fit(x_local, y_local, batch_size=4, epochs=1, shuffle=False, verbose=0,
                  callbacks=[kd_callbacks.BroadcastGlobalVariablesCallback(0)])
        assert opt.loss_scale
        assert float(opt.dynamic_scale) == 2.0, float(opt.dynamic_scale)
        assert int(opt.inner_optimizer.iterations) == 2
        same_on_every_rank(model.get_weights() + [np.asarray(v) for v in opt.variables],
                           "mixed-precision state")
    finally:
        keras.config.set_dtype_policy("float32")


def check_xla():
    """jit_compile=True trains in sync with a keras_dist callback; on TensorFlow,
    without one it fails clearly (on JAX the collective is a host callback
    inside the compiled step, so it trains either way)."""
    x, y = data(SIZE * 4 * 2, seed=15)
    x_local, y_local = shard((x.astype("float32"), y.astype("float32")), batch_size=4)
    if BACKEND == "torch":
        # One step: torch.compile compiles the step again for the second one (its
        # guard on p.grad being None fails), the same reduction at twice the CPU.
        x_local, y_local = x_local[:4], y_local[:4]
    model = mlp(4)
    model.compile(DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse", jit_compile=True)
    model.fit(x_local, y_local, batch_size=4, epochs=1, verbose=0,
              callbacks=[kd_callbacks.BroadcastGlobalVariablesCallback(0)])
    same_on_every_rank(model.get_weights(), "XLA weights")
    if SIZE > 1 and BACKEND == "jax":
        model = mlp(4)
        model.compile(DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse", jit_compile=True)
        model.fit(x_local, y_local, batch_size=4, epochs=1, verbose=0)
        same_on_every_rank(model.get_weights(), "XLA weights without a callback")
    elif SIZE > 1 and BACKEND == "tensorflow":
        model = mlp(4)
        model.compile(DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse", jit_compile=True)
        try:
            model.fit(x_local, y_local, batch_size=4, epochs=1, verbose=0)
        except Exception as error:  # the error TF re-raises from tracing
            assert "XLA-compiled step" in str(error), error
        else:
            raise AssertionError("jit_compile=True without a callback should fail clearly")
        # A plain script on a GPU machine: Keras turns jit_compile="auto" on whenever
        # TensorFlow sees a GPU (a stand-in GPU here). keras_dist turns it off for a
        # model whose DistributedOptimizer reduces, and the step trains without XLA.
        import tensorflow as tf

        real = tf.config.list_physical_devices

        def with_a_gpu(device_type=None):
            devices = real(device_type)
            if device_type in (None, "GPU"):
                devices = [*devices, tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")]
            return devices

        model = mlp(4)
        tf.config.list_physical_devices = with_a_gpu
        try:
            plain = mlp(4)
            plain.compile(keras.optimizers.SGD(0.1), "mse")
            assert plain.jit_compile, "Keras should turn XLA on where it sees a GPU"
            model.compile(DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse")
        finally:
            tf.config.list_physical_devices = real
        assert model.jit_compile is False
        model.fit(x_local, y_local, batch_size=4, epochs=1, verbose=0)
        same_on_every_rank(model.get_weights(), "weights of a plain fit where Keras saw a GPU")


def check_save_and_resume():
    """A model saved at N ranks loads with its optimizer state and resumes in sync."""
    x, y = data(SIZE * 4 * 2, seed=16)
    x_local, y_local = shard((x.astype("float32"), y.astype("float32")), batch_size=4)
    model = mlp(6)
    model.compile(DistributedOptimizer(keras.optimizers.Adam(0.01)), "mse")
    fit = dict(batch_size=4, epochs=1, shuffle=False, verbose=0)
    model.fit(x_local, y_local, **fit)
    directory = kd.broadcast_object(tempfile.mkdtemp() if RANK == 0 else None)
    path = os.path.join(directory, "model.keras")
    if RANK == 0:
        model.save(path)
    kd.barrier()
    restored = load_model(path)
    assert isinstance(restored.optimizer, DistributedOptimizer)
    model.fit(x_local, y_local, **fit)
    restored.fit(x_local, y_local, **fit)
    close(restored.get_weights(), [np.asarray(w, np.float64) for w in model.get_weights()],
          "resumed", 1e-6, 1e-7)
    same_on_every_rank(restored.get_weights(), "resumed weights")


run_checks([check_exactness_and_collective_count, check_backward_passes,
            check_options_on_one_step, check_callbacks, check_schedule_callback,
            check_mixed_precision_overflow_on_one_rank, check_xla, check_save_and_resume],
           rank=RANK, passed="{name} ok rank={rank}", agree=kd.allgather_object)
print(f"KERAS CHECKS OK rank={RANK} size={SIZE}", flush=True)
