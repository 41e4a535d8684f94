"""A plain ``fit`` with a BackupAndRestore callback, restartable by running it again.

Used by tests/multiprocess/test_backup_and_restore.py::

    kdrun -np N python backup.py DIR keras|kd [--kill-epoch K]

``keras`` passes a plain ``keras.callbacks.BackupAndRestore``, ``kd`` passes
``kd.callbacks.BackupAndRestore``. Each rank's backup directory is
``DIR/host<rank>/backup``, as if every rank ran on a host of its own with no
shared file system: only rank 0's may ever exist. With ``--kill-epoch K``,
rank 1 SIGKILLs itself at the second batch of epoch K (0-based), after rank
0's backup of epoch K - 1, unless ``DIR/fault-injected`` says it already did:
so the same command, run again, finishes.

Every rank prints the epoch and optimizer iterations its ``fit`` started at
and a digest of its state then and at the end; ranks check that they all
hold the same state. Rank 0 writes ``DIR/result-np<N>.npz``: its state when
its first epoch began (``loaded/<i>``) and after every epoch (``epoch<e>/<i>``),
the variables' paths in ``paths``.

The data order is deterministic (``shuffle=False``, sharded by global
batch) and the global batch is the same at 1, 2 or 3 ranks.
"""

import hashlib
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

import keras_dist as kd  # noqa: E402

EPOCHS, SAMPLES, FEATURES, CLASSES, GLOBAL_BATCH = 4, 144, 6, 3, 24
STEPS = SAMPLES // GLOBAL_BATCH

directory, kind = sys.argv[1], sys.argv[2]
kill_epoch = int(sys.argv[4]) if sys.argv[3:4] == ["--kill-epoch"] else None
kd.init()
RANK, SIZE = kd.rank(), kd.size()
LOCAL_BATCH = GLOBAL_BATCH // SIZE
BACKUP_DIR = os.path.join(directory, f"host{RANK}", "backup")
FAULT_MARKER = os.path.join(directory, "fault-injected")


def make_data():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(SAMPLES, FEATURES)).astype("float32")
    y = np.argmax(x @ rng.normal(size=(FEATURES, CLASSES)), axis=1).astype("int32")
    return x, y


def new_model():
    # The variables' names (the npz's paths) as in a fresh process, though the
    # test runs this worker after another in one process (workers/suites.py).
    keras.backend.clear_session()
    keras.utils.set_random_seed(100 + RANK)  # ranks differ; the broadcasts make them equal
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(CLASSES),
    ])
    # Adam's moments and the schedule depend on `iterations`: a restore that
    # lost the optimizer state would not end with the uninterrupted weights.
    schedule = keras.optimizers.schedules.ExponentialDecay(0.03, decay_steps=STEPS,
                                                           decay_rate=0.7)
    model.compile(optimizer=kd.DistributedOptimizer(keras.optimizers.Adam(schedule)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def state(model):
    variables = list(model.weights) + list(model.optimizer.variables)
    return [v.path for v in variables], [keras.ops.convert_to_numpy(v) for v in variables]


def digest(values):
    blob = b"".join(v.tobytes() for v in values)
    blobs = kd.allgather_object(blob)
    assert all(b == blob for b in blobs), f"rank {RANK}: ranks hold different state"
    return hashlib.sha256(blob).hexdigest()[:16]


class Record(keras.callbacks.Callback):
    """The state each epoch began (first one only) and ended with."""

    def __init__(self, record):
        super().__init__()
        self.record = record
        self.first_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        if self.first_epoch is not None:
            return
        self.first_epoch = epoch
        paths, values = state(self.model)
        iterations = int(self.model.optimizer.iterations)
        print(f"rank {RANK}: fit starts at epoch {epoch}, optimizer iterations {iterations}, "
              f"state {digest(values)}", flush=True)
        self.record["paths"] = np.array(paths)
        for index, value in enumerate(values):
            self.record[f"loaded/{index}"] = value

    def on_epoch_end(self, epoch, logs=None):
        for index, value in enumerate(state(self.model)[1]):
            self.record[f"epoch{epoch + 1}/{index}"] = value


class KillOnce(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.epoch == kill_epoch and batch == 1 and not os.path.exists(FAULT_MARKER):
            open(FAULT_MARKER, "w").close()
            print(f"KILLING rank {RANK} in epoch {self.epoch}, batch {batch}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    x, y = make_data()
    x_local, y_local = kd.shard((x, y), batch_size=LOCAL_BATCH)
    model = new_model()
    backup_class = (keras.callbacks.BackupAndRestore if kind == "keras"
                    else kd.callbacks.BackupAndRestore)
    record = {}
    callbacks = [kd.callbacks.BroadcastGlobalVariablesCallback(0),
                 backup_class(BACKUP_DIR), Record(record)]
    if RANK == 1 and kill_epoch is not None:
        callbacks.append(KillOnce())
    model.fit(x_local, y_local, batch_size=LOCAL_BATCH, epochs=EPOCHS, shuffle=False,
              verbose=0, callbacks=callbacks)
    iterations = int(model.optimizer.iterations)
    final = digest(state(model)[1])
    if RANK == 0:
        np.savez(os.path.join(directory, f"result-np{SIZE}.npz"), **record)
    print(f"BACKUP WORKER OK rank {RANK} size {SIZE}: optimizer iterations {iterations}, "
          f"state {final}", flush=True)


main()
