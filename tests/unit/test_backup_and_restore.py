"""BackupAndRestore in one process: Keras' callback, unchanged (several ranks:
tests/multiprocess/test_backup_and_restore.py)."""

import inspect
import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import keras_dist as kd  # noqa: E402
from keras_dist._keras.callbacks.backup_and_restore import BackupAndRestore  # noqa: E402
from keras_dist._keras.optimizer import DistributedOptimizer  # noqa: E402

HOOKS = ("on_train_begin", "on_epoch_end", "on_train_batch_end", "on_train_end")
EPOCHS, INTERRUPT_AT, SAMPLES, BATCH = 4, 2, 12, 4
STEPS = SAMPLES // BATCH


@pytest.fixture(scope="module", autouse=True)
def _init():
    kd.init()


def test_is_keras_callback_with_its_constructor():
    assert kd.callbacks.BackupAndRestore is BackupAndRestore
    assert issubclass(BackupAndRestore, keras.callbacks.BackupAndRestore)
    assert inspect.signature(BackupAndRestore) == \
        inspect.signature(keras.callbacks.BackupAndRestore)


def test_keras_class_has_the_distributed_hooks_once_the_keras_layer_is_loaded():
    for name in HOOKS:
        assert keras.callbacks.BackupAndRestore.__dict__[name] is \
            BackupAndRestore.__dict__[name], name


class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == INTERRUPT_AT:
            raise RuntimeError("interrupted")


class Epochs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.started = []

    def on_epoch_begin(self, epoch, logs=None):
        self.started.append(epoch)


def _model():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(DistributedOptimizer(keras.optimizers.Adam(0.05)), "mse")
    return model


def _fit(model, callbacks):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(SAMPLES, 3)), rng.normal(size=(SAMPLES, 1))
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=callbacks)


def _state(model):
    return [keras.ops.convert_to_numpy(v) for v in model.weights + model.optimizer.variables]


@pytest.mark.parametrize("backup_class", [BackupAndRestore, keras.callbacks.BackupAndRestore],
                         ids=["kd", "keras"])
def test_interrupted_fit_resumes_where_the_backup_left_off(tmp_path, backup_class):
    reference = _model()
    _fit(reference, [])

    backup_dir = tmp_path / "backup"
    model = _model()
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(model, [backup_class(str(backup_dir)), Interrupt()])
    metadata = json.loads((backup_dir / "training_metadata.json").read_text())
    assert metadata["epoch"] == INTERRUPT_AT

    model = _model()  # a new process would start from a new model
    epochs = Epochs()
    _fit(model, [backup_class(str(backup_dir)), epochs])
    assert epochs.started == list(range(INTERRUPT_AT, EPOCHS))
    assert int(model.optimizer.iterations) == EPOCHS * STEPS
    for actual, expected in zip(_state(model), _state(reference), strict=True):
        np.testing.assert_array_equal(actual, expected)
    assert not backup_dir.exists()


def test_keras_class_is_changed_by_init_not_by_import():
    code = (
        "import keras, keras_dist as kd\n"
        "from keras_dist._keras.callbacks.backup_and_restore import BackupAndRestore\n"
        "ours = BackupAndRestore.__dict__['on_train_begin']\n"
        "assert keras.callbacks.BackupAndRestore.on_train_begin is not ours\n"
        "kd.init()\n"
        "assert keras.callbacks.BackupAndRestore.on_train_begin is ours\n"
        "print('CHANGED BY INIT')\n")
    _run_fresh(code, "CHANGED BY INIT")


def test_keras_layer_imported_after_init_changes_keras_class():
    code = (
        "import keras_dist as kd, sys\n"
        "kd.init()\n"
        "assert 'keras' not in sys.modules  # kd.init() alone loads no framework\n"
        "import keras\n"
        "from keras_dist import DistributedOptimizer\n"
        "from keras_dist._keras.callbacks.backup_and_restore import BackupAndRestore\n"
        "ours = BackupAndRestore.__dict__['on_train_begin']\n"
        "assert keras.callbacks.BackupAndRestore.on_train_begin is ours\n"
        "print('CHANGED ON IMPORT AFTER INIT')\n")
    _run_fresh(code, "CHANGED ON IMPORT AFTER INIT")


def _run_fresh(code: str, marker: str) -> None:
    """Runs ``code`` in a new process (Keras' class is process state) and
    checks that it printed ``marker``."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=240, env={**os.environ, "KERAS_BACKEND": "jax"})
    assert marker in result.stdout, result.stdout + result.stderr
