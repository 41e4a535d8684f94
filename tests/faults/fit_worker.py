"""A rank training a small Keras model with ``model.fit``; with ``FAULT_STEP``
set, rank ``FAULT_RANK`` (default 1) SIGKILLs itself (``FAULT_KIND=kill``) or
raises (``FAULT_KIND=raise``) at that training step, in the middle of fit."""

import os
import signal

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dist as kd  # noqa: E402

kd.init()
fault_step = int(os.environ.get("FAULT_STEP", "-1"))
fault_rank = int(os.environ.get("FAULT_RANK", "1"))
fault_kind = os.environ.get("FAULT_KIND", "kill")


class InjectFault(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        step = self.params["steps"] * self._epoch + batch
        if kd.rank() == fault_rank and step == fault_step:
            print(f"FAULT at step {step}", flush=True)
            if fault_kind == "raise":
                raise RuntimeError(f"injected fault at step {step}")
            os.kill(os.getpid(), signal.SIGKILL)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch


rng = np.random.default_rng(kd.rank())
x = rng.normal(size=(256, 8)).astype("float32")
y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(1, activation="sigmoid")])
model.compile(optimizer=kd.DistributedOptimizer(keras.optimizers.SGD(0.05)),
              loss="binary_crossentropy")
print("FITTING", kd.rank(), flush=True)
model.fit(x, y, batch_size=32, epochs=int(os.environ.get("FIT_EPOCHS", "3")), verbose=0,
          callbacks=[kd.callbacks.BroadcastGlobalVariablesCallback(0), InjectFault()])
print("FINISHED", kd.rank(), flush=True)
