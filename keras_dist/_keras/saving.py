"""Saving and loading a model trained with a ``DistributedOptimizer``."""

from __future__ import annotations

import keras

from keras_dist._keras import zero_saving
from keras_dist._keras.lr import ScaledSchedule
from keras_dist._keras.optimizer import DistributedOptimizer
from keras_dist._runtime import context


def load_model(path, custom_optimizers=None, custom_objects=None, compile: bool = True,
               safe_mode: bool = True):
    """Loads a `.keras` model saved with a `DistributedOptimizer`.

    The optimizer comes back wrapped, with the inner optimizer's state
    (slots, iterations, loss scale, accumulators), so training resumes at any
    number of ranks. With `shard_optimizer_state=True`, call it on every rank:
    each rank reads the file and keeps its own share of the state (a file
    written by `save_model`, or by an unsharded run, at any number of ranks).

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


def save_model(model, filepath, overwrite: bool = True, **kwargs) -> None:
    """Saves `model` to a `.keras` file: call it on every rank; rank 0 writes it.

    With a `DistributedOptimizer(shard_optimizer_state=True)`, every rank
    holds only its share of the optimizer state: the shares are gathered
    into the file one variable at a time (never the whole state on one rank),
    in the layout the unsharded optimizer saves, so the
    file loads into a sharded or unsharded optimizer at any number of ranks
    (`load_model`). Without sharding, rank 0 saves as `model.save` does. The
    other ranks return once the file is written; if rank 0 fails to write
    it, every rank raises.

    Args:
        model: the model (the same on every rank).
        filepath: the `.keras` file (on rank 0's file system).
        overwrite: as in `model.save`.
        **kwargs: passed on to `model.save`.

    Example:

    ```python
    kd.save_model(model, "model.keras")   # on every rank, not under `if kd.rank() == 0`
    ```
    """
    with zero_saving.rank_zero_io(zero_saving.sharding(model)):
        if context.get().rank == 0:
            model.save(filepath, overwrite=overwrite, **kwargs)
