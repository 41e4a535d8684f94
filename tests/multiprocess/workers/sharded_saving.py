"""Saving and resuming a sharded-optimizer run (DistributedOptimizer(shard_optimizer_state=True)).

``sharded_saving.py save`` (2 ranks): the Horovod habit of saving on rank 0
alone (``model.save`` and ``ModelCheckpoint``) raises at once on rank 0 and
hangs nothing; ``kd.save_model`` on every rank writes the whole optimizer
state in the layout of the unsharded optimizer (compared with the file an
unsharded twin run writes); training continues for a few steps (the
reference, written to SAVING_DIR/reference.npz); the file loaded again at 2
ranks continues to the same weights; BackupAndRestore writes a backup (and
the reference of the uninterrupted run); BestModelCheckpoint on every rank
writes a file that continues as the run that wrote it.

``sharded_saving.py load`` (any number of ranks): the file loaded by
``kd.load_model`` into a sharded optimizer, and by ``load_weights`` into an
unsharded one, continues to the reference weights; the backup resumes the
second epoch to the uninterrupted run's weights.

Every step trains on the same global batch of GLOBAL rows, split evenly
between the ranks, so the averaged gradients (float64) are the same at any
number of ranks. Prints "SAVING <check> passed rank=R" per check and
"SAVING OK rank=R" at the end.
"""

import os
import sys
import zipfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

if os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow":
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
elif os.environ["KERAS_BACKEND"] == "torch":
    import torch

    torch.set_num_threads(1)

import keras  # noqa: E402

import keras_dist as kd  # noqa: E402
from tests.multiprocess.workers._checks import run_checks  # noqa: E402

keras.config.set_floatx("float64")  # inputs too: the runs at 2 and 3 ranks agree to 1e-15
kd.init()
RANK, SIZE = kd.rank(), kd.size()
DIRECTORY = os.environ["SAVING_DIR"]
SAVED = os.path.join(DIRECTORY, "sharded.keras")
REFERENCE = os.path.join(DIRECTORY, "reference.npz")
GLOBAL, BEFORE, AFTER = 6, 3, 3  # rows per step; steps before and after the save
RNG = np.random.default_rng(7)
X = RNG.normal(size=((BEFORE + AFTER) * GLOBAL, 12))
Y = RNG.normal(size=((BEFORE + AFTER) * GLOBAL, 3))


def make(shard):
    keras.utils.set_random_seed(1)  # the same start on every rank and in every run
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, dtype="float64"),
                              keras.layers.Dense(3, dtype="float64")])
    model.compile(loss="mse", optimizer=kd.DistributedOptimizer(
        keras.optimizers.Adam(0.01), shard_optimizer_state=shard))
    return model


def fit(model, first, steps, callbacks=(), epochs=1):
    """``steps`` steps (an epoch) from global step ``first``: this rank's rows of each
    global batch."""
    rows = GLOBAL // SIZE
    picked = np.concatenate([np.arange(s * GLOBAL + RANK * rows, s * GLOBAL + (RANK + 1) * rows)
                             for s in range(first, first + steps)])
    model.fit(X[picked], Y[picked], batch_size=rows, epochs=epochs, shuffle=False, verbose=0,
              callbacks=list(callbacks))


def weights(model):
    return [np.asarray(keras.ops.convert_to_numpy(v), np.float64) for v in model.weights]


def check_resumed(model, reference, what):
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == BEFORE, what
    fit(model, BEFORE, AFTER)
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


def check_rank_zero_save_raises():
    """`if kd.rank() == 0: model.save(...)` raises at once on rank 0; nothing waits."""
    model = make(True)
    fit(model, 0, 1)
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
    model = make(True)
    callbacks = []
    if RANK == 0:
        callbacks = [keras.callbacks.ModelCheckpoint(os.path.join(DIRECTORY, "ckpt.keras"))]
    try:
        fit(model, 0, 1, callbacks)
    except ValueError as error:
        assert RANK == 0 and "kd.save_model(model, filepath)" in str(error), error
        print(f"rank 0 refused: {error}", flush=True)
    else:
        assert RANK != 0, "ModelCheckpoint on rank 0 alone did not raise"


REFERENCE_WEIGHTS = []


def check_save_whole():
    """kd.save_model on every rank: the whole state, in the unsharded optimizer's layout."""
    model, twin = make(True), make(False)
    fit(model, 0, BEFORE)
    fit(twin, 0, BEFORE)
    kd.save_model(model, SAVED)
    kd.save_model(twin, os.path.join(DIRECTORY, "unsharded.keras"))
    if RANK == 0:
        sharded = optimizer_entries(SAVED)
        unsharded = optimizer_entries(os.path.join(DIRECTORY, "unsharded.keras"))
        assert sorted(sharded) == sorted(unsharded), (sorted(sharded), sorted(unsharded))
        for name, value in unsharded.items():
            np.testing.assert_allclose(sharded[name], value, rtol=1e-6, atol=0, err_msg=name)
    fit(model, BEFORE, AFTER)
    REFERENCE_WEIGHTS[:] = weights(model)
    save_reference(REFERENCE, REFERENCE_WEIGHTS)


def check_load_sharded():
    """kd.load_model at this number of ranks re-shards; training continues exactly."""
    model = kd.load_model(SAVED)
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
    continues as the run that wrote it does."""
    path = os.path.join(DIRECTORY, "best.keras")
    model = make(True)
    fit(model, 0, BEFORE, [kd.callbacks.BestModelCheckpoint(monitor="loss", filepath=path)])
    loaded = kd.load_model(path)
    fit(model, BEFORE, AFTER)
    check_resumed(loaded, weights(model), "BestModelCheckpoint's file")


def check_keras_state_refuses():
    """Elastic commits cannot hold a sharded state yet: KerasState says so at once."""
    try:
        kd.elastic.KerasState(make(True), epoch=0)
    except ValueError as error:
        assert "shard_optimizer_state=False" in str(error), error
    else:
        raise AssertionError("KerasState took a sharded optimizer")


def save_reference(path, arrays):
    if RANK == 0:
        np.savez(path, *arrays)


def load_reference(path):
    with np.load(path) as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]


BACKUP_DIR = os.path.join(DIRECTORY, "backup")
BACKUP_REFERENCE = os.path.join(DIRECTORY, "backup_reference.npz")


def check_backup_written():
    """BackupAndRestore on every rank writes the whole state at an epoch's end; the
    reference is the run of two epochs without interruption."""
    model = make(True)
    fit(model, 0, BEFORE, [keras.callbacks.BackupAndRestore(BACKUP_DIR,
                                                            delete_checkpoint=False)])
    if RANK == 0:
        assert os.listdir(BACKUP_DIR), "no backup written"
    uninterrupted = make(True)
    fit(uninterrupted, 0, BEFORE, epochs=2)
    save_reference(BACKUP_REFERENCE, weights(uninterrupted))


def check_backup_resumed():
    """The backup of a 2-rank run resumes a sharded run at this number of ranks exactly."""
    model = make(True)
    fit(model, 0, BEFORE, [keras.callbacks.BackupAndRestore(BACKUP_DIR)], epochs=2)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 2 * BEFORE
    resumed = weights(model)
    for index, (got, want) in enumerate(zip(resumed, load_reference(BACKUP_REFERENCE))):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, err_msg=f"weight {index}")
    blobs = kd.allgather_object([w.tobytes() for w in resumed])
    assert all(b == blobs[0] for b in blobs), "the ranks' weights differ"


if sys.argv[1] == "save":
    checks = [check_rank_zero_save_raises, check_rank_zero_checkpoint_raises,
              check_save_whole, check_load_sharded, check_backup_written,
              check_best_model_checkpoint, check_keras_state_refuses]
else:
    REFERENCE_WEIGHTS[:] = load_reference(REFERENCE)
    checks = [check_load_sharded, check_load_unsharded, check_backup_resumed]
run_checks(checks, rank=RANK, passed="SAVING {name} passed rank={rank}",
           agree=kd.allgather_object)
print(f"SAVING OK rank={RANK}", flush=True)
