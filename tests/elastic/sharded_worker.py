"""An elastic Keras script whose DistributedOptimizer shards its state
(``shard_optimizer_state=True``), for test_elastic_sharded.py.

    kdrun ... python sharded_worker.py OUT_DIR EPOCHS

Every step trains one global batch of GLOBAL samples whatever the number of
ranks (local batch GLOBAL // size, from ``ElasticData``, shuffled per
epoch), in float64 with a constant learning rate, so a run resized between
launches trains on the same batches, to the same weights up to rounding, as
an uninterrupted run at any size. KD_SHARD=0 turns sharding off.

Events (environment), each at the start of a batch (epoch E, batch B as the
elastic state counts them), in the launch that reaches it first:
  KD_LOSE=R:E:B:PATH  rank R creates PATH (the discovery script then offers
                      one slot fewer) and SIGKILLs itself
  KD_GROW=E:B:PATH    rank 0 creates PATH (the discovery script then offers
                      more slots) and every rank waits for kdrun's notice of
                      new hosts, which ends the launch for a resize
Writes OUT_DIR/start.launch<L>.rank<R>.json (the size, the commit resumed
from) when training starts and OUT_DIR/launch<L>.rank<R>.npz at the end:
the model's weights and the state a commit holds (float64, flattened, in the
unsharded layout), the counters.
"""

import json
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from tests._threads import one_thread_per_rank  # noqa: E402

one_thread_per_rank()
import keras  # noqa: E402

import keras_dist as hvd  # noqa: E402

keras.config.set_floatx("float64")
out, epochs = sys.argv[1], int(sys.argv[2])
hvd.init()
launch = int(os.environ.get("KERAS_DIST_ELASTIC_ROUND", "0"))
SAMPLES, FEATURES, GLOBAL = 48, 6, 12  # GLOBAL divides among 2 and 3 ranks
rng = np.random.default_rng(11)
x = rng.normal(size=(SAMPLES, FEATURES))
y = rng.normal(size=(SAMPLES, 2))
# Set rather than seeded: the same start on every rank, launch and backend.
initial = [rng.normal(scale=0.4, size=(FEATURES, 16)), np.zeros(16),
           rng.normal(scale=0.4, size=(16, 2)), np.zeros(2)]

model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="tanh"),
                          keras.layers.Dense(2)])
model.set_weights(initial)
model.compile(loss="mse", optimizer=hvd.DistributedOptimizer(
    keras.optimizers.Adam(0.01), shard_optimizer_state=os.environ.get("KD_SHARD", "1") == "1"))
state = hvd.elastic.KerasState(model, batch=0, epoch=0)
data = hvd.elastic.ElasticData((x, y), batch_size=GLOBAL // hvd.size(), state=state,
                               shuffle_seed=5)


def event(name):
    """(fields before the batch, path) of event ``name`` when it falls at the batch
    about to start and its file is not made yet (rank 0 decides), else None."""
    fields = os.environ.get(name, "").split(":")
    if len(fields) < 3:
        return None
    *who, epoch, batch, path = fields
    due = (state.epoch, state.batch) == (int(epoch), int(batch)) and not os.path.exists(path)
    return (who, path) if hvd.broadcast_object(due, root_rank=0) else None


class Events(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        lose = event("KD_LOSE")
        if lose is not None and hvd.rank() == int(lose[0][0]):
            open(lose[1], "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        grow = event("KD_GROW")
        if grow is not None:
            if hvd.rank() == 0:
                open(grow[1], "w").close()
            while True:  # ends with HostsUpdatedInterrupt: kdrun relaunches at the new size
                state.check_host_updates()
                time.sleep(0.1)


callbacks = [Events(), hvd.elastic.CommitStateCallback(state, batches_per_commit=1),
             hvd.elastic.UpdateBatchStateCallback(state),
             hvd.elastic.UpdateEpochStateCallback(state)]


@hvd.elastic.run
def train(state):
    with open(os.path.join(out, f"start.launch{launch}.rank{hvd.rank()}.json"), "w") as f:
        json.dump({"size": hvd.size(), "resumed": (state.resumed_from or {}).get("commit"),
                   "start": [state.epoch, state.batch]}, f)
    model.fit(data.batches(), steps_per_epoch=data.steps_per_epoch(),
              epochs=epochs - state.epoch, callbacks=callbacks, shuffle=False, verbose=0)


train(state)


def flat(arrays):
    return np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in arrays])


np.savez(os.path.join(out, f"launch{launch}.rank{hvd.rank()}.npz"),
         weights=flat(keras.ops.convert_to_numpy(v) for v in model.weights),
         state=flat(state._capture()[0]),
         info=json.dumps({"end": [state.epoch, state.batch], "size": hvd.size()}))
print(f"SHARDED WORKER OK launch={launch} rank={hvd.rank()} size={hvd.size()}", flush=True)
