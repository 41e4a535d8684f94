"""A Horovod-style elastic Keras script (hvd.elastic.run, KerasState, the
three callbacks, a reset callback that rescales the learning rate).

    kdrun ... python keras_worker.py OUT_DIR EPOCHS

Data: 96 random samples (fixed seed), fed through ``hvd.elastic.ElasticData``
(local batch 8, shuffled per epoch). Kill points (environment), one per
launch separated by ";" (the first for launch 0, the next for launch 1...):
  KD_KILL=batch:R:E:B     rank R SIGKILLs itself before batch B of epoch E
  KD_KILL=commit:R:N      rank R SIGKILLs itself inside its N-th commit
  KD_KILL=epoch:R:E       rank R SIGKILLs itself at the end of epoch E (between epochs)
  KD_KILL=timer:R:S       rank R SIGKILLs itself S seconds after training starts
KD_TOUCH_BEFORE_KILL=PATH: the dying rank creates PATH first (a discovery
script can then offer fewer slots). KD_BATCH_SLEEP=S slows each batch down.
Writes OUT_DIR/trace.launch<L>.rank<R>.jsonl as it trains (a line per batch:
epoch, commit, the samples' ids) and, at the end, OUT_DIR/launch<L>.rank<R>.npz:
the final weights and optimizer state (flattened, in order), the counters,
loss and accuracy, the learning rates seen.
"""

import json
import os
import signal
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

import keras_dist as hvd

out, epochs = sys.argv[1], int(sys.argv[2])
hvd.init()
import keras  # noqa: E402

if keras.backend.backend() == "tensorflow":
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)

launch = int(os.environ.get("KERAS_DIST_ELASTIC_ROUND", "0"))
# KD_KILL holds one kill point per launch, separated by ";" (launch 0's first).
plan = os.environ.get("KD_KILL", "").split(";")
kill = plan[launch].split(":") if launch < len(plan) else [""]
rng = np.random.default_rng(0)


def die():
    """SIGKILLs this rank (creating the file KD_TOUCH_BEFORE_KILL first, when given)."""
    if os.environ.get("KD_TOUCH_BEFORE_KILL"):
        open(os.environ["KD_TOUCH_BEFORE_KILL"], "w").close()
    os.kill(os.getpid(), signal.SIGKILL)


N, FEATURES, BATCH, BASE_LR = 96, 6, 8, 0.02
x = rng.normal(size=(N, FEATURES)).astype("float32")
x[:, 0] = np.arange(N, dtype="float32")  # the sample's id, read back by the recorder
y = (x[:, 1:3].sum(axis=1) > 0).astype("int32")
x_model = x.copy()

keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Lambda(lambda t: t[:, 1:]),
                          keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(BASE_LR * hvd.size())),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
state = hvd.elastic.KerasState(model, batch=0, epoch=0)
seen = {"lr": [], "resets": 0}


def on_state_reset():
    model.optimizer.learning_rate.assign(BASE_LR * hvd.size())
    seen["resets"] += 1


state.register_reset_callbacks([on_state_reset])
data = hvd.elastic.ElasticData((x, y), batch_size=BATCH, state=state, shuffle_seed=5)
yielded = []


def recorded(batches):
    for batch in batches:
        yielded.append(batch[0][:, 0].astype(int).tolist())
        yield batch


trace = open(os.path.join(out, f"trace.launch{launch}.rank{hvd.rank()}.jsonl"), "w")
batch_sleep = float(os.environ.get("KD_BATCH_SLEEP", "0"))


def note(**record):
    trace.write(json.dumps(record) + "\n")
    trace.flush()


class Recorder(keras.callbacks.Callback):
    """Writes a line per trained batch: the epoch, the commit made after it, the
    samples' ids (the i-th yielded batch is the i-th trained step)."""

    def __init__(self):
        super().__init__()
        self.trained = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = state.epoch
        seen["lr"].append(float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)))

    def on_train_batch_end(self, batch, logs=None):
        # Called before CommitStateCallback's: the commit made after this batch
        # is the next one (every batch commits).
        note(epoch=self.epoch, batch=batch, commit=state.commit_number + 1,
             ids=yielded[self.trained])
        self.trained += 1
        time.sleep(batch_sleep)


class Killer(keras.callbacks.Callback):
    timer = None

    def on_train_begin(self, logs=None):
        if kill[0] == "timer" and hvd.rank() == int(kill[1]):
            self.timer = threading.Timer(float(kill[2]), die)
            self.timer.start()

    def on_train_end(self, logs=None):
        if self.timer is not None:
            self.timer.cancel()

    def on_train_batch_begin(self, batch, logs=None):
        if kill[0] == "batch" and hvd.rank() == int(kill[1]) and (
                state.epoch, state.batch) == (int(kill[2]), int(kill[3])):
            die()

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = state.epoch

    def on_epoch_end(self, epoch, logs=None):
        if kill[0] == "epoch" and hvd.rank() == int(kill[1]) and self.epoch == int(kill[2]):
            die()


if kill[0] == "commit" and hvd.rank() == int(kill[1]):
    commits = [0]
    write = state._write_commit

    def dying_write():
        commits[0] += 1
        if commits[0] == int(kill[2]):
            die()
        write()

    state._write_commit = dying_write

recorder = Recorder()
callbacks = [Killer(), recorder, hvd.elastic.CommitStateCallback(state, batches_per_commit=1),
             hvd.elastic.UpdateBatchStateCallback(state),
             hvd.elastic.UpdateEpochStateCallback(state)]


@hvd.elastic.run
def train(state):
    seen["start"] = (state.epoch, state.batch)
    note(resumed=(state.resumed_from or {}).get("commit"), start=seen["start"],
         size=hvd.size(), lr=float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)))
    model.fit(recorded(data.batches()), steps_per_epoch=data.steps_per_epoch(),
              epochs=epochs - state.epoch, callbacks=callbacks, shuffle=False, verbose=0)


train(state)
weights = np.concatenate([np.ravel(keras.ops.convert_to_numpy(v))
                          for v in model.variables + model.optimizer.variables])
loss, accuracy = model.evaluate(x_model, y, verbose=0)
np.savez(os.path.join(out, f"launch{launch}.rank{hvd.rank()}.npz"), weights=weights,
         info=json.dumps({"end": [state.epoch, state.batch], "size": hvd.size(),
                          "loss": loss, "accuracy": accuracy, **seen}))
print(f"KERAS WORKER OK launch={launch} rank={hvd.rank()} size={hvd.size()} "
      f"epoch={state.epoch} batch={state.batch} loss={loss:.6f}")
