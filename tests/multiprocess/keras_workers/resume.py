"""A small training job that checkpoints on rank 0 each epoch, can be killed, and resumes.

Used by tests/multiprocess/test_resume.py. One script, three modes:

    kdrun -np 2 python resume.py full   DIR   # uninterrupted, EPOCHS epochs
    kdrun -np 2 python resume.py kill   DIR   # rank 1 SIGKILLs itself inside epoch KILL_AFTER+1
    kdrun -np N python resume.py resume DIR   # from DIR's newest checkpoint, on to EPOCHS

Every mode writes DIR/ckpt-<epoch>.keras from rank 0 (``ModelCheckpoint``).
Rank 0 also writes ``DIR/<mode>-np<N>.npz`` with the model's weights and the
optimizer's variables (in order; their paths in ``paths``): the state every
epoch ended with (``epoch<e>/<i>``), and, when resuming, the state just
loaded (``loaded/<i>``). The test compares these files.

The data order is deterministic (``shuffle=False``, sharded by global batch),
and the global batch is the same at any number of ranks (local batch =
GLOBAL_BATCH / size), so one rank sees what two ranks see together.
"""

import glob
import os
import re
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

import keras_dist as kd  # noqa: E402

EPOCHS, KILL_AFTER = 4, 2  # the killed run dies inside epoch KILL_AFTER + 1 (1-based)
SAMPLES, FEATURES, CLASSES, GLOBAL_BATCH = 256, 10, 3, 32
STEPS = SAMPLES // GLOBAL_BATCH

mode, directory = sys.argv[1], sys.argv[2]
assert mode in ("full", "kill", "resume"), mode
kd.init()
RANK, SIZE = kd.rank(), kd.size()
LOCAL_BATCH = GLOBAL_BATCH // SIZE


def make_data():
    """Random inputs; labels from a random linear teacher plus noise (seeded: same on all ranks)."""
    rng = np.random.default_rng(2024)
    x = rng.normal(size=(SAMPLES, FEATURES)).astype("float32")
    teacher = rng.normal(size=(FEATURES, CLASSES))
    y = np.argmax(x @ teacher + 0.3 * rng.normal(size=(SAMPLES, CLASSES)), axis=1)
    return x, y.astype("int32")


def new_model():
    keras.utils.set_random_seed(1234 + RANK)  # ranks differ; the broadcast makes them equal
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(CLASSES),
    ])
    # Adam's moments and the schedule both depend on `iterations`: a resume that
    # lost the optimizer state would not end with the same weights.
    schedule = keras.optimizers.schedules.ExponentialDecay(0.02, decay_steps=STEPS,
                                                           decay_rate=0.8)
    model.compile(
        optimizer=kd.DistributedOptimizer(keras.optimizers.Adam(schedule)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def state(model):
    """Weights then the optimizer's variables (the wrapper's and the wrapped one's)."""
    variables = list(model.weights) + list(model.optimizer.variables)
    inner = model.optimizer.inner_optimizer
    seen = {id(v) for v in variables}
    variables += [v for v in inner.variables if id(v) not in seen]
    return [v.path for v in variables], [keras.ops.convert_to_numpy(v) for v in variables]


def latest_checkpoint():
    """(epoch, path) of the newest checkpoint in ``directory`` (rank 0 looks), or (0, None)."""
    found = None
    if RANK == 0:
        epochs = [int(m.group(1)) for p in glob.glob(os.path.join(directory, "ckpt-*.keras"))
                  if (m := re.fullmatch(r"ckpt-(\d+)\.keras", os.path.basename(p)))]
        if epochs:
            found = (max(epochs), os.path.join(directory, f"ckpt-{max(epochs)}.keras"))
    return kd.broadcast_object(found or (0, None), root_rank=0)


class Snapshots(keras.callbacks.Callback):
    """Keeps rank 0's whole training state at the end of every epoch."""

    def __init__(self, record):
        super().__init__()
        self.record = record

    def on_epoch_end(self, epoch, logs=None):
        paths, values = state(self.model)
        self.record["paths"] = np.array(paths)
        for index, value in enumerate(values):
            self.record[f"epoch{epoch + 1}/{index}"] = value


class EpochEndBarrier(keras.callbacks.Callback):
    """Nobody starts the next epoch before rank 0's checkpoint is on disk.

    Placed after ``ModelCheckpoint`` (callbacks run in list order), so a rank
    that dies at the start of the next epoch never cuts rank 0's write short.
    """

    def on_epoch_end(self, epoch, logs=None):
        kd.barrier()


class KillRankOne(keras.callbacks.Callback):
    """SIGKILLs this process at the second batch of epoch ``KILL_AFTER + 1``."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.epoch == KILL_AFTER and batch == 1:
            print(f"KILLING rank {RANK} in epoch {self.epoch + 1}, batch {batch + 1}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    x, y = make_data()
    x_local, y_local = kd.shard((x, y), batch_size=LOCAL_BATCH)
    record = {}
    initial_epoch, path = latest_checkpoint() if mode == "resume" else (0, None)
    if mode == "resume":
        assert path is not None, f"no checkpoint in {directory}"
        model = kd.load_model(path)  # every rank reads rank 0's file (shared filesystem)
        assert isinstance(model.optimizer, kd.DistributedOptimizer), type(model.optimizer)
        iterations = int(model.optimizer.inner_optimizer.iterations)
        assert iterations == initial_epoch * STEPS, (iterations, initial_epoch)
        paths, values = state(model)
        record["loaded_paths"] = np.array(paths)
        for index, value in enumerate(values):
            record[f"loaded/{index}"] = value
        print(f"rank {RANK}: resuming from {os.path.basename(path)} at epoch {initial_epoch}, "
              f"optimizer iterations {iterations}", flush=True)
    else:
        model = new_model()

    callbacks = [kd.callbacks.BroadcastGlobalVariablesCallback(0),
                 kd.callbacks.MetricAverageCallback()]
    if RANK == 0:
        callbacks.append(keras.callbacks.ModelCheckpoint(
            os.path.join(directory, "ckpt-{epoch}.keras")))
        callbacks.append(Snapshots(record))
    callbacks.append(EpochEndBarrier())
    if mode == "kill" and RANK == 1:
        callbacks.append(KillRankOne())

    history = model.fit(x_local, y_local, batch_size=LOCAL_BATCH, epochs=EPOCHS,
                        initial_epoch=initial_epoch, shuffle=False, verbose=0,
                        callbacks=callbacks)
    if mode == "kill":
        raise SystemExit(f"rank {RANK}: the job should have been killed in epoch {KILL_AFTER + 1}")

    # Every rank ends with the same state.
    _, values = state(model)
    blobs = kd.allgather_object(b"".join(v.tobytes() for v in values))
    assert all(blob == blobs[0] for blob in blobs), "ranks ended with different state"
    loss, accuracy = history.history["loss"][-1], history.history["accuracy"][-1]
    iterations = int(model.optimizer.inner_optimizer.iterations)
    assert iterations == EPOCHS * STEPS, iterations
    if RANK == 0:
        np.savez(os.path.join(directory, f"{mode}-np{SIZE}.npz"), **record)
    print(f"RESUME WORKER OK mode={mode} rank={RANK} size={SIZE} epochs={initial_epoch}->{EPOCHS} "
          f"loss={loss:.6f} accuracy={accuracy:.4f} iterations={iterations}", flush=True)


main()
