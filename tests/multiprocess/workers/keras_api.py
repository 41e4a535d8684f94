"""Horovod's Keras callbacks beyond the core four, checked on every rank.
Prints "KERASAPI <check> passed rank=R" per check."""

import os
import shutil
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

import keras_dist as kd  # noqa: E402
from tests.multiprocess.workers._checks import run_checks  # noqa: E402

kd.init()
RANK, SIZE = kd.rank(), kd.size()


def test_best_model_checkpoint_saves_the_best_on_rank_0_only():
    directory = kd.broadcast_object(tempfile.mkdtemp() if RANK == 0 else None)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=kd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    saves = []
    save = model.save
    model.save = lambda *args, **kwargs: (saves.append(args), save(*args, **kwargs))
    rng = np.random.default_rng(RANK)
    x = rng.normal(size=(32, 3))
    y = x @ np.array([[1.0], [-2.0], [0.5]])
    history = model.fit(
        x, y, batch_size=8, epochs=4, verbose=0, validation_data=(x[:8], y[:8]),
        callbacks=[kd.callbacks.BroadcastGlobalVariablesCallback(0),
                   kd.callbacks.MetricAverageCallback(),
                   kd.callbacks.BestModelCheckpoint(
                       filepath=os.path.join(directory, "best.keras"), monitor="val_loss")])
    counts = kd.allgather_object(len(saves))
    losses = history.history["val_loss"]
    improvements = sum(1 for i, v in enumerate(losses) if v < min(losses[:i], default=np.inf))
    assert counts == [improvements] + [0] * (SIZE - 1), (counts, losses)
    if RANK == 0:
        best = kd.load_model(os.path.join(directory, "best.keras"))
        if SIZE == 1:  # val_loss is then this rank's own: the saved model reproduces it
            assert abs(best.evaluate(x[:8], y[:8], verbose=0) - min(losses)) < 1e-5
        shutil.rmtree(directory)
    kd.barrier()


if __name__ == "__main__":
    run_checks([function for name, function in list(globals().items())
                if name.startswith("test_")],
               rank=RANK, passed="KERASAPI {name} passed rank={rank}", agree=kd.allgather_object)
