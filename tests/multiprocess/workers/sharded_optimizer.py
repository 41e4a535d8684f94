"""DistributedOptimizer(shard_optimizer_state=True) against the unsharded one, on every rank.

For each check, the same variables (same start on every rank) are trained
twice in this process: by the unsharded DistributedOptimizer (the reference)
and by the sharded one, each rank with its own seeded gradients (which depend
on the current weights, as real gradients do). After the steps the weights must
agree (float64, rtol 1e-6) and be identical on every rank; the rank's state
must hold only its share. The backend is KERAS_BACKEND. Prints
"SHARDED <check> passed rank=R" per check, "SHARDED OK rank=R" at the end.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from tests._threads import one_thread_per_rank  # noqa: E402

one_thread_per_rank()
if os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow":
    import tensorflow as tf

import keras  # noqa: E402

import keras_dist as kd  # noqa: E402
from tests.multiprocess.workers._checks import run_checks  # noqa: E402

kd.init()
RANK, SIZE = kd.rank(), kd.size()
BACKEND = keras.backend.backend()
STEPS = int(os.environ.get("SHARDED_STEPS", "50"))

# The first variable is over half of the bytes: element-wise optimizers split it.
SHAPES = [(24, 20), (20,), (20, 6), (6,), (6, 1), (1,)]
NAMES = ["kernel_0", "bias_0", "kernel_1", "bias_1", "kernel_2", "bias_2"]


def start_values(seed):
    rng = np.random.default_rng([seed, 999])
    return [rng.normal(size=shape) for shape in SHAPES]


def variables_from(values):
    return [keras.Variable(v.astype("float32"), name=n) for v, n in zip(values, NAMES)]


def grads_for(weights, rank, seed, step, spoil=False):
    rng = np.random.default_rng([seed, rank, step])
    grads = [0.1 * w + rng.normal(size=w.shape) for w in weights]
    if spoil:
        grads[2][0, 0] = np.inf
    return [g.astype("float32") for g in grads]


def train(optimizer, variables, seed, steps=STEPS, spoil_step=None):
    """``steps`` applies of this rank's gradients (eager; one tf.function on TF)."""
    optimizer.build(variables)

    def apply(grads):
        optimizer.apply(grads, variables)

    if BACKEND == "tensorflow":
        apply = tf.function(apply)
    elif BACKEND == "jax":  # as Keras's trainer: stateless_apply inside jax.jit
        import jax

        stateless = jax.jit(optimizer.stateless_apply)

        def apply(grads):
            new_weights, new_state = stateless([v.value for v in optimizer.variables], grads,
                                               [v.value for v in variables])
            for variable, value in zip(list(variables) + list(optimizer.variables),
                                       list(new_weights) + list(new_state)):
                variable.assign(value)
    for step in range(steps):
        weights = [np.asarray(keras.ops.convert_to_numpy(v)) for v in variables]
        grads = grads_for(weights, RANK, seed, step, spoil=(step == spoil_step and RANK == 0))
        apply([keras.ops.convert_to_tensor(g) for g in grads])
    return [np.asarray(keras.ops.convert_to_numpy(v), np.float64) for v in variables]


def same_on_every_rank(arrays, what):
    blobs = kd.allgather_object([np.asarray(a).tobytes() for a in arrays])
    assert all(b == blobs[0] for b in blobs), f"{what}: the ranks' weights differ"


def state_bytes(optimizer):
    inner = optimizer.inner_optimizer
    return sum(int(np.prod(v.shape)) * 4 for v in inner.variables if len(v.shape))


def compare(make, seed, options=None, steps=STEPS, spoil_step=None, prepare=None):
    """Trains with and without sharding; returns both optimizers."""
    options = options or {}
    results, optimizers = [], []
    for shard in (False, True):
        inner = make()
        if prepare is not None:
            prepare(inner)
        optimizer = kd.DistributedOptimizer(inner, shard_optimizer_state=shard, **options)
        variables = variables_from(start_values(seed))
        results.append(train(optimizer, variables, seed, steps, spoil_step))
        optimizers.append(optimizer)
        if shard and inner.use_ema:
            optimizer.finalize_variable_values(variables)
            results[-1] = [np.asarray(keras.ops.convert_to_numpy(v), np.float64)
                           for v in variables]
    name = type(optimizers[1].inner_optimizer).__name__
    if optimizers[0].inner_optimizer.use_ema:
        optimizers[0].finalize_variable_values(optimizers[0]._trainable_variables)
        results[0] = [np.asarray(keras.ops.convert_to_numpy(v), np.float64)
                      for v in optimizers[0]._trainable_variables]
    for index, (sharded, reference) in enumerate(zip(results[1], results[0])):
        np.testing.assert_allclose(sharded, reference, rtol=1e-6, atol=1e-7,
                                   err_msg=f"{name} {options}: variable {index}")
    same_on_every_rank(results[1], f"{name} {options}")
    return optimizers


OPTIMIZERS = {
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "adamax": lambda: keras.optimizers.Adamax(0.01),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "adagrad": lambda: keras.optimizers.Adagrad(0.05),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "ftrl": lambda: keras.optimizers.Ftrl(0.05, l1_regularization_strength=0.01),
    "lion": lambda: keras.optimizers.Lion(0.001),
    "lamb": lambda: keras.optimizers.Lamb(0.01),
    "adafactor": lambda: keras.optimizers.Adafactor(0.05),
}
if hasattr(keras.optimizers, "Muon"):
    OPTIMIZERS["muon"] = lambda: keras.optimizers.Muon(0.01)
SWEEP = os.environ.get("SHARDED_OPTIMIZERS")  # a comma-separated subset of OPTIMIZERS
if SWEEP:
    OPTIMIZERS = {name: make for name, make in OPTIMIZERS.items()
                  if name in SWEEP.split(",") or name == "adam"}


def test_every_optimizer_matches_the_unsharded_one():
    for seed, (name, make) in enumerate(OPTIMIZERS.items()):
        reference, sharded = compare(make, seed)
        if SIZE > 1:
            mine, whole = state_bytes(sharded), state_bytes(reference)
            total = sum(kd.allgather_object(mine))
            assert mine < whole, f"{name}: rank holds {mine} of {whole} bytes of state"
            assert total == whole, f"{name}: shares hold {total} bytes, unsharded {whole}"


def test_each_rank_holds_its_share_of_adam_state():
    reference, sharded = compare(OPTIMIZERS["adam"], 40, steps=1)
    whole, mine = state_bytes(reference), state_bytes(sharded)
    shares = kd.allgather_object(mine)
    assert sum(shares) == whole, (shares, whole)
    # Row splits: every share within one row (20 floats, two slots) of the even share.
    assert max(shares) <= whole / SIZE + 2 * 20 * 4, (shares, whole)
    replicated = sharded.replicated_variables()
    shapes = kd.allgather_object([tuple(v.shape) for v in replicated])
    assert all(s == shapes[0] for s in shapes), shapes


def test_clipping_options():
    for seed, options in ((50, {"clipnorm": 0.5}), (51, {"clipvalue": 0.1}),
                          (52, {"global_clipnorm": 0.5})):
        compare(lambda o=options: keras.optimizers.Adam(0.01, **o), seed)


def test_weight_decay_with_exclusions():
    def prepare(optimizer):
        optimizer.exclude_from_weight_decay(var_names=["bias"])

    compare(lambda: keras.optimizers.AdamW(0.01, weight_decay=0.2), 60, prepare=prepare)


def test_ema_and_learning_rate_schedule():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.02, decay_steps=5, decay_rate=0.8)
    compare(lambda: keras.optimizers.Adam(schedule, use_ema=True, ema_momentum=0.9,
                                          ema_overwrite_frequency=7), 70)
    compare(lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.9), 71, steps=10)


def test_backward_passes_per_step_and_gradient_accumulation_steps():
    if BACKEND == "jax":  # refused there, in one sentence
        for options in ({"backward_passes_per_step": 2}, {}):
            inner = keras.optimizers.Adam(0.01, gradient_accumulation_steps=None if options
                                          else 2)
            try:
                kd.DistributedOptimizer(inner, shard_optimizer_state=True, **options)
            except NotImplementedError as error:
                assert "does not support backward_passes_per_step" in str(error)
            else:
                raise AssertionError(f"not refused: {options}")
        return
    compare(OPTIMIZERS["adam"], 80, {"backward_passes_per_step": 2}, steps=12)
    compare(lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=3), 81, steps=12)


def test_loss_scaling_skips_a_step_on_every_rank():
    # Rank 0's gradient is inf at step 3: the reduced gradient is inf on every
    # rank, every rank skips that step and halves the scale.
    reference, sharded = compare(OPTIMIZERS["adam"], 90, {"loss_scale": True,
                                                          "dynamic_growth_steps": 4},
                                 steps=12, spoil_step=3)
    for optimizer in (reference, sharded):
        scale = float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))
        assert scale == 2.0**15 / 2 * 2 * 2, scale  # halved once, doubled twice since
        assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 11


def test_reduction_options():
    compare(OPTIMIZERS["adam"], 100, {"op": kd.Sum, "compression": kd.Compression.fp16,
                                      "groups": 2}, steps=10)


def test_fit_matches_the_unsharded_fit():
    rng = np.random.default_rng([7, RANK])
    x = rng.normal(size=(64, 12)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    weights = []
    for shard in (False, True):
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=kd.DistributedOptimizer(keras.optimizers.Adam(0.01),
                                                        shard_optimizer_state=shard),
                      loss="mse")
        model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                  callbacks=[kd.callbacks.BroadcastGlobalVariablesCallback(0)])
        weights.append([np.asarray(w, np.float64) for w in model.get_weights()])
    for index, (sharded, reference) in enumerate(zip(weights[1], weights[0])):
        np.testing.assert_allclose(sharded, reference, rtol=1e-6, atol=1e-7,
                                   err_msg=f"fit: weight {index}")
    same_on_every_rank(weights[1], "fit")


def test_refusals():
    refused = []
    for make in (lambda: kd.DistributedOptimizer(keras.optimizers.SGD(),
                                                 process_set=kd.global_process_set,
                                                 shard_optimizer_state=True),
                 lambda: kd.PartialDistributedOptimizer(
                     keras.optimizers.SGD(), local_layers=[keras.layers.Dense(1)],
                     shard_optimizer_state=True),
                 lambda: kd.DistributedOptimizer(keras.optimizers.SGD(),
                                                 shard_optimizer_state="yes")):
        try:
            make()
        except ValueError as error:
            refused.append(str(error))
    assert len(refused) == 3, refused


CHECKS = [test_every_optimizer_matches_the_unsharded_one,
            test_each_rank_holds_its_share_of_adam_state,
            test_clipping_options, test_weight_decay_with_exclusions,
            test_ema_and_learning_rate_schedule,
            test_backward_passes_per_step_and_gradient_accumulation_steps,
            test_loss_scaling_skips_a_step_on_every_rank, test_reduction_options,
            test_fit_matches_the_unsharded_fit, test_refusals]
ONLY = os.environ.get("SHARDED_ONLY")  # a comma-separated subset, when debugging
run_checks([c for c in CHECKS if not ONLY or c.__name__ in ONLY.split(",")],
           rank=RANK, passed="SHARDED {name} passed rank={rank}", agree=kd.allgather_object)
print(f"SHARDED OK rank={RANK}", flush=True)
