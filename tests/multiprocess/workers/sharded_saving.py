"""Saving and resuming a sharded-optimizer run (DistributedOptimizer(shard_optimizer_state=True)).

``sharded_saving.py save`` (2 ranks): one sharded run trains an epoch with
BackupAndRestore and BestModelCheckpoint given to every rank;
``kd.save_model`` on every rank then writes the whole optimizer state in the
layout of the unsharded optimizer (compared with the file an unsharded twin
run writes); the run trains a second epoch (the reference of the
uninterrupted run, written to SAVING_DIR/reference.npz); the file loaded
again at 2 ranks, and BestModelCheckpoint's file, continue to the same
weights; the backup was written; on the same run, the Horovod habit of
saving on rank 0 alone (``model.save`` and ``ModelCheckpoint``) raises at
once on rank 0 and hangs nothing.

``sharded_saving.py load`` (any number of ranks): the file loaded by
``kd.load_model`` into a sharded optimizer, and by ``load_weights`` into an
unsharded one, continues to the reference weights; the backup, restored
into the loaded sharded model, resumes the second epoch to the
uninterrupted run's weights.

Every epoch trains the same STEPS global batches of GLOBAL rows, split evenly
between the ranks, so the averaged gradients (float64) are the same at any
number of ranks. Every model starts from the same weights (INITIAL, set
rather than seeded: the same values on every backend, and
``keras.utils.set_random_seed`` would import TensorFlow, where installed, to
seed it too). The first kernel (12 x 16) is split between the ranks at 2 and
at 3 (see docs/zero.md's partition). Prints "SAVING <check> passed rank=R"
per check and "SAVING OK rank=R" at the end.
"""

import os
import sys
import zipfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from tests._threads import one_thread_per_rank  # noqa: E402

one_thread_per_rank()
import keras  # noqa: E402

import keras_dist as kd  # noqa: E402
from tests.multiprocess.workers._checks import run_checks  # noqa: E402

keras.config.set_floatx("float64")  # inputs too: the runs at 2 and 3 ranks agree to 1e-15
kd.init()
RANK, SIZE = kd.rank(), kd.size()
DIRECTORY = os.environ["SAVING_DIR"]
SAVED = os.path.join(DIRECTORY, "sharded.keras")
REFERENCE = os.path.join(DIRECTORY, "reference.npz")
GLOBAL, STEPS = 6, 3  # rows per step; steps per epoch (before the save, and after it)
RNG = np.random.default_rng(7)
X = RNG.normal(size=(STEPS * GLOBAL, 12))
Y = RNG.normal(size=(STEPS * GLOBAL, 3))
# Keras's defaults, drawn here: Glorot-uniform kernels, zero biases.
INITIAL = [RNG.uniform(-(6 / 28) ** 0.5, (6 / 28) ** 0.5, (12, 16)), np.zeros(16),
           RNG.uniform(-(6 / 19) ** 0.5, (6 / 19) ** 0.5, (16, 3)), np.zeros(3)]


def make(shard):
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, dtype="float64"),
                              keras.layers.Dense(3, dtype="float64")])
    model.set_weights(INITIAL)  # the same start on every rank and in every run
    model.compile(loss="mse", optimizer=kd.DistributedOptimizer(
        keras.optimizers.Adam(0.01), shard_optimizer_state=shard))
    return model


def fit(model, steps=STEPS, callbacks=(), epochs=1):
    """Epochs of the first ``steps`` global batches: this rank's rows of each."""
    rows = GLOBAL // SIZE
    picked = np.concatenate([np.arange(s * GLOBAL + RANK * rows, s * GLOBAL + (RANK + 1) * rows)
                             for s in range(steps)])
    model.fit(X[picked], Y[picked], batch_size=rows, epochs=epochs, shuffle=False, verbose=0,
              callbacks=list(callbacks))


def weights(model):
    return [np.asarray(keras.ops.convert_to_numpy(v), np.float64) for v in model.weights]


def check_resumed(model, reference, what):
    """``model``, saved after the first epoch, trains the second to ``reference``."""
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == STEPS, what
    fit(model)
    check_weights(model, reference, what)


def check_weights(model, reference, what):
    """``model``'s weights are ``reference``'s (1e-6 relative), bytewise alike on every rank."""
    resumed = weights(model)
    for index, (got, want) in enumerate(zip(resumed, reference)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, err_msg=f"{what}: weight {index}")
    blobs = kd.allgather_object([w.tobytes() for w in resumed])
    assert all(b == blobs[0] for b in blobs), f"{what}: the ranks' weights differ"


def optimizer_entries(path):
    import h5py

    with zipfile.ZipFile(path) as archive, archive.open("model.weights.h5") as raw:
        with h5py.File(raw, "r") as h5:
            found = {}
            h5.visititems(lambda name, item: found.__setitem__(name, np.asarray(item))
                          if name.startswith("optimizer/") and hasattr(item, "shape") else None)
            return found


#: The save job's sharded run (made by check_save_whole), reused by the checks after it;
#: the load job's model loaded by check_load_sharded, reused by check_backup_resumed.
MODELS = {}
REFERENCE_WEIGHTS = []
BEST = os.path.join(DIRECTORY, "best.keras")
BACKUP_DIR = os.path.join(DIRECTORY, "backup")


def sharded_run():
    """The save job's sharded run; one trained for a step if check_save_whole made none."""
    if "run" not in MODELS:
        MODELS["run"] = make(True)
        fit(MODELS["run"], 1)
    return MODELS["run"]


def check_save_whole():
    """kd.save_model on every rank: the whole state, in the unsharded optimizer's layout.

    The run's first epoch also writes a backup (BackupAndRestore) and BestModelCheckpoint's
    file on every rank; its second epoch is the reference of the uninterrupted run."""
    model = MODELS["run"] = make(True)
    twin = make(False)
    fit(model, callbacks=[kd.callbacks.BestModelCheckpoint(monitor="loss", filepath=BEST),
                          keras.callbacks.BackupAndRestore(BACKUP_DIR, delete_checkpoint=False)])
    fit(twin)
    kd.save_model(model, SAVED)
    kd.save_model(twin, os.path.join(DIRECTORY, "unsharded.keras"))
    if RANK == 0:
        sharded = optimizer_entries(SAVED)
        unsharded = optimizer_entries(os.path.join(DIRECTORY, "unsharded.keras"))
        assert sorted(sharded) == sorted(unsharded), (sorted(sharded), sorted(unsharded))
        for name, value in unsharded.items():
            np.testing.assert_allclose(sharded[name], value, rtol=1e-6, atol=0, err_msg=name)
    fit(model)
    REFERENCE_WEIGHTS[:] = weights(model)
    if RANK == 0:
        np.savez(REFERENCE, *REFERENCE_WEIGHTS)


def check_load_sharded():
    """kd.load_model at this number of ranks re-shards; training continues exactly."""
    model = MODELS["loaded"] = kd.load_model(SAVED)
    assert model.optimizer.shard_optimizer_state
    check_resumed(model, REFERENCE_WEIGHTS, f"sharded, loaded at {SIZE} ranks")


def check_load_unsharded():
    """The same file into an unsharded optimizer: every rank gets the whole state."""
    model = make(False)
    model.optimizer.build(model.trainable_variables)
    model.load_weights(SAVED)
    check_resumed(model, REFERENCE_WEIGHTS, f"unsharded, loaded at {SIZE} ranks")


def check_best_model_checkpoint():
    """kd.callbacks.BestModelCheckpoint on every rank writes the whole state: the file
    (written at the first epoch's end) continues as the run that wrote it does."""
    check_resumed(kd.load_model(BEST), REFERENCE_WEIGHTS, "BestModelCheckpoint's file")


def check_backup_written():
    """BackupAndRestore on every rank wrote the whole state at the first epoch's end."""
    if RANK == 0:
        assert os.listdir(BACKUP_DIR), "no backup written"


def check_backup_resumed():
    """The backup of a 2-rank run resumes a sharded run at this number of ranks exactly:
    restored into the model check_load_sharded trained on (every weight and slot
    overwritten, or the comparison fails), the second epoch gives the uninterrupted
    run's weights."""
    model = MODELS["loaded"] if "loaded" in MODELS else make(True)
    fit(model, callbacks=[keras.callbacks.BackupAndRestore(BACKUP_DIR)], epochs=2)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 2 * STEPS
    check_weights(model, REFERENCE_WEIGHTS, "the backup resumed")


def check_rank_zero_save_raises():
    """`if kd.rank() == 0: model.save(...)` raises at once on rank 0; nothing waits."""
    model = sharded_run()
    if RANK == 0:
        try:
            model.save(os.path.join(DIRECTORY, "rank0.keras"))
        except ValueError as error:
            assert "kd.save_model(model, filepath)" in str(error), error
            print(f"rank 0 refused: {error}", flush=True)
        else:
            raise AssertionError("model.save on rank 0 alone did not raise")


def check_rank_zero_checkpoint_raises():
    """ModelCheckpoint given to rank 0 only raises at once there; the other ranks finish."""
    callbacks = []
    if RANK == 0:
        callbacks = [keras.callbacks.ModelCheckpoint(os.path.join(DIRECTORY, "ckpt.keras"))]
    try:
        fit(sharded_run(), 1, callbacks)
    except ValueError as error:
        assert RANK == 0 and "kd.save_model(model, filepath)" in str(error), error
        print(f"rank 0 refused: {error}", flush=True)
    else:
        assert RANK != 0, "ModelCheckpoint on rank 0 alone did not raise"


if sys.argv[1] == "save":
    # The checks that train the run further (the rank-0-only saves) come last.
    checks = [check_save_whole, check_load_sharded, check_best_model_checkpoint,
              check_backup_written, check_rank_zero_save_raises,
              check_rank_zero_checkpoint_raises]
else:
    with np.load(REFERENCE) as saved:
        REFERENCE_WEIGHTS[:] = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    checks = [check_load_sharded, check_load_unsharded, check_backup_resumed]
run_checks(checks, rank=RANK, passed="SAVING {name} passed rank={rank}",
           agree=kd.allgather_object)
print(f"SAVING OK rank={RANK}", flush=True)
