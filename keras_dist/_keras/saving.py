"""Loading a model saved with a ``DistributedOptimizer``."""

from __future__ import annotations

import keras

from keras_dist._keras.lr import ScaledSchedule
from keras_dist._keras.optimizer import DistributedOptimizer


def load_model(path, custom_optimizers=None, custom_objects=None, compile: bool = True,
               safe_mode: bool = True):
    """Loads a `.keras` model saved with a `DistributedOptimizer`.

    The optimizer comes back wrapped, with the inner optimizer's state
    (slots, iterations, loss scale, accumulators), so training resumes at any
    number of ranks.

    Args:
        path: the `.keras` file.
        custom_optimizers: optimizer classes the file names, as Horovod takes
            them (added to `custom_objects` under their class names).
        custom_objects: extra classes or functions the model needs.
        compile: as in `keras.saving.load_model`.
        safe_mode: as in `keras.saving.load_model`.

    Returns:
        The model.
    """
    objects = {
        "DistributedOptimizer": DistributedOptimizer,
        "keras_dist>DistributedOptimizer": DistributedOptimizer,
        "keras_dist>ScaledSchedule": ScaledSchedule,
    }
    objects.update({cls.__name__: cls for cls in custom_optimizers or ()})
    objects.update(custom_objects or {})
    return keras.saving.load_model(
        path, custom_objects=objects, compile=compile, safe_mode=safe_mode
    )
