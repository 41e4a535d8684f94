"""Horovod's TF1 session path (tf.compat.v1) on every rank, against one-process references.

``BroadcastGlobalVariablesHook`` in ``MonitoredTrainingSession`` (fresh and
restored from rank 0's checkpoint), ``DistributedOptimizer`` over
``tf.compat.v1.train`` optimizers and its options. The references are graph
runs of one process on the global batch, without keras_dist, computed on
every rank (float64). Every rank starts from its own random variables, so
only the broadcast makes them agree. ``TF1_MODE=v1`` runs TensorFlow with
``disable_v2_behavior()`` (reference variables, TF1 control flow), otherwise
with ``disable_eager_execution()`` only. Prints "TF1 <check> passed rank=R"
per check and "TF1 SESSION OK rank=R size=N".
"""

import os
import re

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

v1 = tf.compat.v1
MODE = os.environ.get("TF1_MODE", "eager_off")
if MODE == "v1":
    v1.disable_v2_behavior()
else:
    v1.disable_eager_execution()

import keras  # noqa: E402
from tensorflow.python.eager import context as tf_context  # noqa: E402

import keras_dist as kd  # noqa: E402
from tests.multiprocess.workers._checks import run_checks  # noqa: E402

kd.init(process_sets="dynamic")  # the options check adds a set
RANK, SIZE = kd.rank(), kd.size()
CHECKPOINTS = os.environ["TF1_CHECKPOINTS"]
BATCH = 4  # per rank
STEPS, MORE_STEPS = 4, 3


def config():
    """Horovod's pinning recipe, and one thread each (a 2-core machine)."""
    proto = v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
    proto.gpu_options.allow_growth = True
    proto.gpu_options.visible_device_list = str(kd.local_rank())
    return proto


def start_values(seed):
    rng = np.random.default_rng([seed, 77])
    return {"w1": rng.normal(size=(6, 5)), "b1": rng.normal(size=(5,)) * 0.1,
            "emb": rng.normal(size=(20, 5)), "w2": rng.normal(size=(5, 3)),
            "b2": rng.normal(size=(3,)) * 0.1}


def global_batch(step):
    """The whole job's batch of step ``step`` (each rank trains on its slice)."""
    rng = np.random.default_rng([step, 5])
    return (rng.normal(size=(BATCH * SIZE, 6)), rng.integers(0, 20, BATCH * SIZE),
            rng.integers(0, 3, BATCH * SIZE))


def my_slice(batch):
    return tuple(part[RANK * BATCH:(RANK + 1) * BATCH] for part in batch)


def build_model(values):
    """A small TF1 model (dense layers and an embedding: a sparse gradient)."""
    x = v1.placeholder(tf.float64, [None, 6], name="x")
    ids = v1.placeholder(tf.int32, [None], name="ids")
    labels = v1.placeholder(tf.int32, [None], name="labels")
    variables = {name: v1.get_variable(name, initializer=value)
                 for name, value in values.items()}
    hidden = tf.tanh(tf.matmul(x, variables["w1"]) + variables["b1"]
                     + tf.gather(variables["emb"], ids))
    logits = tf.matmul(hidden, variables["w2"]) + variables["b2"]
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits))
    return (x, ids, labels), variables, loss


def reference(steps, make_optimizer, record=()):
    """One process, the global batch, rank 0's start: the variables (and Adam's
    first moment of w1) after ``steps`` steps and after each step in ``record``."""
    seen = {}
    with tf.Graph().as_default(), v1.Session(config=config()) as session:
        feeds, variables, loss = build_model(start_values(0))
        optimizer = make_optimizer()
        train = optimizer.minimize(loss)
        session.run(v1.global_variables_initializer())
        for step in range(steps):
            session.run(train, dict(zip(feeds, global_batch(step))))
            if step + 1 in record or step + 1 == steps:
                seen[step + 1] = (session.run(variables),
                                  session.run(optimizer.get_slot(variables["w1"], "m")))
    return seen


def close(label, got, want, rtol=1e-9, atol=1e-11):
    for name in want:
        np.testing.assert_allclose(np.asarray(got[name], np.float64), want[name],
                                   rtol=rtol, atol=atol, err_msg=f"{label}: {name}")


def same_on_every_rank(label, arrays):
    blobs = kd.allgather_object(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays))
    differing = [r for r in range(SIZE) if blobs[r] != blobs[0]]
    assert not differing, f"{label}: rank(s) {differing} differ from rank 0"


class _Capture(v1.train.SessionRunHook):
    """Reads ``fetches`` when the session ends (after the last step)."""

    def __init__(self, fetches):
        self.fetches, self.values = fetches, None

    def end(self, session):
        self.values = session.run(self.fetches)


def train_in_monitored_session(first_step, last_step, seed, checkpoint_dir):
    """Trains with Horovod's recipe; returns the variables and global step right
    after the session was created, and the variables, Adam's first moment of
    w1 and the global step at the end."""
    with tf.Graph().as_default():
        feeds, variables, loss = build_model(start_values(seed))
        optimizer = kd.DistributedOptimizer(v1.train.AdamOptimizer(0.05))
        global_step = v1.train.get_or_create_global_step()
        train = optimizer.minimize(loss, global_step=global_step)
        assert isinstance(optimizer, v1.train.Optimizer), type(optimizer)
        capture = _Capture([variables, optimizer.get_slot(variables["w1"], "m"), global_step])
        hooks = [kd.BroadcastGlobalVariablesHook(0),
                 v1.train.StopAtStepHook(last_step=last_step), capture]
        steps = []
        with v1.train.MonitoredTrainingSession(
                checkpoint_dir=checkpoint_dir, hooks=hooks, config=config(),
                save_summaries_steps=None, save_summaries_secs=None,
                log_step_count_steps=None) as session:
            start = session.run([variables, global_step])
            while not session.should_stop():
                step = session.run(global_step)
                steps.append(step)
                session.run(train, dict(zip(feeds, my_slice(global_batch(step)))))
    assert steps == list(range(first_step, last_step)), steps
    return start, capture.values


REFERENCE = {}


def adam_reference():
    if not REFERENCE:
        REFERENCE.update(reference(STEPS + MORE_STEPS, lambda: v1.train.AdamOptimizer(0.05),
                                   record=(STEPS,)))
    return REFERENCE


def test_graph_building_leaves_the_eager_runtime_alone():
    # A session pinned with visible_device_list must be the first to number the
    # GPUs: building the graph (optimizer, hook) starts nothing of TensorFlow's
    # eager runtime (with GPUs, it would number them its own way). (A `tf.cond`
    # under TF2 control flow starts it, keras_dist's for backward_passes_per_step
    # > 1 too: their runtime then sees the rank's GPU, see tensor/tf/glue.py.)
    with tf.Graph().as_default():
        feeds, variables, loss = build_model(start_values(RANK))
        optimizer = kd.DistributedOptimizer(v1.train.AdamOptimizer(0.05))
        optimizer.minimize(loss, global_step=v1.train.get_or_create_global_step())
        kd.BroadcastGlobalVariablesHook(0).begin()
        assert not tf_context.context()._initialized, "graph building started the runtime"


def test_monitored_training_session_matches_one_process():
    directory = os.path.join(CHECKPOINTS, "run") if RANK == 0 else None
    start, (end, moment, reached) = train_in_monitored_session(0, STEPS, RANK, directory)
    want = adam_reference()[STEPS]
    close("after the broadcast", start[0], start_values(0), rtol=0, atol=0)
    assert start[1] == 0 and reached == STEPS, (start[1], reached)
    close("trained", end, want[0])
    close("Adam slot m", {"w1": moment}, {"w1": want[1]})
    same_on_every_rank("trained", list(end.values()) + [moment])
    if RANK == 0:
        assert v1.train.latest_checkpoint(directory), os.listdir(directory)


def test_hook_broadcasts_the_restored_checkpoint():
    # Rank 0 restores its checkpoint (step 4, Adam's slots included); the
    # others start from fresh random variables, then take rank 0's.
    directory = os.path.join(CHECKPOINTS, "run") if RANK == 0 else None
    start, (end, moment, reached) = train_in_monitored_session(
        STEPS, STEPS + MORE_STEPS, 1000 + RANK, directory)
    reference_ = adam_reference()
    close("restored and broadcast", start[0], reference_[STEPS][0])
    assert start[1] == STEPS, f"global step after the broadcast: {start[1]}"
    same_on_every_rank("restored", list(start[0].values()))
    close("trained on", end, reference_[STEPS + MORE_STEPS][0])
    close("Adam slot m", {"w1": moment}, {"w1": reference_[STEPS + MORE_STEPS][1]})
    assert reached == STEPS + MORE_STEPS
    same_on_every_rank("trained on", list(end.values()))


def per_rank_gradients(rank):
    rng = np.random.default_rng([31, rank])
    return rng.normal(size=(4, 3)), rng.integers(0, 6, 3), rng.normal(size=(3, 3))


def dense_grads(rank):
    """Rank ``rank``'s gradients of ``loss`` below: d/dv and d/dE (scattered rows)."""
    coefficients, rows, row_values = per_rank_gradients(rank)
    table = np.zeros((6, 3))
    np.add.at(table, rows, row_values)
    return coefficients, table


def reduced_gradients(**options):
    """compute_gradients of loss_r = sum(c_r * v) + sum(E[rows_r] * d_r) with ``options``."""
    coefficients, rows, row_values = per_rank_gradients(RANK)
    with tf.Graph().as_default(), v1.Session(config=config()) as session:
        v = v1.get_variable("v", initializer=np.zeros((4, 3)))
        table = v1.get_variable("table", initializer=np.zeros((6, 3)))
        loss = (tf.reduce_sum(v * coefficients)
                + tf.reduce_sum(tf.gather(table, rows) * row_values))
        optimizer = kd.DistributedOptimizer(v1.train.GradientDescentOptimizer(1.0), **options)
        pairs = optimizer.compute_gradients(loss)
        grads = [tf.convert_to_tensor(g) for g, _ in pairs]
        session.run(v1.global_variables_initializer())
        return session.run(grads)


def test_compute_gradients_reduces_with_every_option():
    everyone = [dense_grads(r) for r in range(SIZE)]
    mean = [np.mean([g[i] for g in everyone], 0) for i in range(2)]
    total = [np.sum([g[i] for g in everyone], 0) for i in range(2)]
    cases = [({}, mean, 1e-12), ({"op": kd.Sum}, total, 1e-12),
             ({"gradient_predivide_factor": 2.0}, mean, 1e-12),
             ({"compression": kd.Compression.fp16}, mean, 2e-3),
             ({"sparse_as_dense": True}, mean, 1e-12), ({"groups": 2}, mean, 1e-12),
             ({"num_groups": 2, "sparse_as_dense": True}, mean, 1e-12)]
    for options, want, tolerance in cases:
        got = reduced_gradients(**options)
        for name, g, w in zip(("v", "table"), got, want):
            np.testing.assert_allclose(g, w, rtol=tolerance, atol=tolerance,
                                       err_msg=f"{options}: {name}")
    if SIZE > 1:
        members = list(range(0, SIZE, 2))
        subset = kd.add_process_set(members)
        try:
            got = reduced_gradients(process_set=subset)
            inside = [dense_grads(r) for r in members]
            want = ([np.mean([g[i] for g in inside], 0) for i in range(2)]
                    if RANK in members else list(dense_grads(RANK)))
            for name, g, w in zip(("v", "table"), got, want):
                np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12,
                                           err_msg=f"process set {members}: {name}")
        finally:
            kd.remove_process_set(subset)


def test_backward_passes_and_momentum_slots():
    # SGD over k=2 passes: applied on every second step, global_step counting
    # the applications; Momentum's slot through get_slot.
    passes, lr = 2, 0.5
    grads = {r: np.random.default_rng([41, r]).normal(size=(4, 3)) for r in range(SIZE)}
    for average in (False, True):
        with tf.Graph().as_default(), v1.Session(config=config()) as session:
            variable = v1.get_variable("v", initializer=np.ones(3))
            scale = v1.placeholder(tf.float64, [3])
            optimizer = kd.DistributedOptimizer(
                v1.train.GradientDescentOptimizer(lr), backward_passes_per_step=passes,
                average_aggregated_gradients=average)
            global_step = v1.train.get_or_create_global_step()
            train = optimizer.minimize(tf.reduce_sum(variable * scale), global_step=global_step)
            session.run([v1.global_variables_initializer(), v1.local_variables_initializer()])
            expected = np.ones(3)
            for step in range(4):
                session.run(train, {scale: grads[RANK][step]})
                if step % passes == passes - 1:
                    summed = [grads[r][step - 1] + grads[r][step] for r in range(SIZE)]
                    expected = expected - lr * np.mean(summed, 0) / (passes if average else 1)
                np.testing.assert_allclose(session.run(variable), expected, rtol=1e-12,
                                           err_msg=f"average={average} step {step}")
                assert session.run(global_step) == (step + 1) // passes
    with tf.Graph().as_default(), v1.Session(config=config()) as session:
        variable = v1.get_variable("v", initializer=np.zeros(3))
        scale = v1.placeholder(tf.float64, [3])
        # Hyperparameters exact in float32: TF1 optimizers keep them so.
        optimizer = kd.DistributedOptimizer(v1.train.MomentumOptimizer(0.25, momentum=0.5))
        pairs = optimizer.compute_gradients(tf.reduce_sum(variable * scale))
        clipped = [(tf.clip_by_value(g, -1.0, 1.0), v) for g, v in pairs]
        train = optimizer.apply_gradients(clipped)
        session.run(v1.global_variables_initializer())
        accumulator, expected = np.zeros(3), np.zeros(3)
        for step in range(2):
            session.run(train, {scale: grads[RANK][step]})
            mean = np.clip(np.mean([grads[r][step] for r in range(SIZE)], 0), -1.0, 1.0)
            accumulator = 0.5 * accumulator + mean
            expected = expected - 0.25 * accumulator
        np.testing.assert_allclose(session.run(optimizer.get_slot(variable, "momentum")),
                                   accumulator, rtol=1e-12)
        np.testing.assert_allclose(session.run(variable), expected, rtol=1e-12)
        assert optimizer.get_slot_names() == ["momentum"], optimizer.get_slot_names()


def raises(pattern, function):
    try:
        function()
    except ValueError as error:
        assert re.search(pattern, str(error)), f"{pattern!r} not in {error}"
        assert "\n" not in str(error), f"not one sentence: {error}"
    else:
        raise AssertionError(f"no error matching {pattern!r}")


def test_mixing_in_keras_3_is_one_sentence():
    with tf.Graph().as_default():
        raises(r"Keras 3 does not train a model in TF1 graph mode.*tf\.compat\.v1\.train",
               lambda: kd.DistributedOptimizer(keras.optimizers.Adam()))
        x = v1.placeholder(tf.float32, [None, 3])
        layer = keras.layers.Dense(2)
        loss = tf.reduce_sum(layer(x))
        optimizer = kd.DistributedOptimizer(v1.train.AdamOptimizer(0.1))
        raises(r"must hold TensorFlow variables, not Keras 3 variables",
               lambda: optimizer.minimize(loss, var_list=layer.trainable_variables))
        # Without var_list, the Keras layer's own TF variables train.
        assert optimizer.minimize(loss) is not None
        raises(r"`root_rank` must be in \[0, size\)\. Received: "
               rf"root_rank={SIZE} \(size={SIZE}\)",
               lambda: kd.BroadcastGlobalVariablesHook(SIZE))
        raises(r"`root_rank` must be an integer",
               lambda: kd.BroadcastGlobalVariablesHook(keras.Sequential()))
        raises(r"must not already be a DistributedOptimizer",
               lambda: kd.DistributedOptimizer(optimizer))


run_checks([test_graph_building_leaves_the_eager_runtime_alone,
            test_monitored_training_session_matches_one_process,
            test_hook_broadcasts_the_restored_checkpoint,
            test_compute_gradients_reduces_with_every_option,
            test_backward_passes_and_momentum_slots,
            test_mixing_in_keras_3_is_one_sentence],
           rank=RANK, passed="TF1 {name} passed rank={rank}", agree=kd.allgather_object)
print(f"TF1 SESSION OK rank={RANK} size={SIZE}")
