"""``KerasState``: a Keras model and its optimizer as elastic state.

A ``DistributedOptimizer(shard_optimizer_state=True)`` holds on each rank only
its share of the optimizer state, which a commit of that share alone would
lose with the rank and could not re-shard at another size. Its commits hold
the whole state instead, in the unsharded layout (what ``kd.save_model``
writes), gathered on every rank a variable at a time
(``zero_saving.gather_everywhere``): every rank keeps a host copy of the
whole state, as with an unsharded optimizer, and the optimizer's memory on
the device stays the share. Restoring, at this or any other number of ranks,
keeps each rank's rows (``zero_saving.keep_share``). See docs/zero.md.
"""

from __future__ import annotations

import keras
import numpy as np

from keras_dist._keras import zero_saving
from keras_dist._keras.backends import sync_model_state
from keras_dist.elastic.state import ObjectState


class KerasState(ObjectState):
    """A model's and its optimizer's variables, plus any keyword values
    (Horovod's ``hvd.elastic.KerasState``).

    With ``DistributedOptimizer(shard_optimizer_state=True)`` a commit holds
    the whole optimizer state (every rank gathers the shares: a collective,
    as a commit is) and a restore at any number of ranks re-shards it.

    Args:
        model: a built Keras model.
        optimizer: its optimizer; defaults to ``model.optimizer``. Built here
            when it is not yet, so that its variables are part of every commit.
        **kwargs: picklable values kept with it, as attributes (``epoch=0,
            batch=0`` for the elastic callbacks).

    Raises:
        ValueError: the model is not built, or has no optimizer and none is given.
    """

    def __init__(self, model, optimizer=None, **kwargs) -> None:
        if not getattr(model, "built", False):
            raise ValueError(
                "KerasState needs a built model: call `model.build(input_shape)` or the "
                f"model once first. Received: an unbuilt {type(model).__name__}")
        optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if optimizer is None:
            raise ValueError("KerasState needs an optimizer: compile the model first or pass "
                             "`optimizer=`. Received: a model without an optimizer")
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        self.model = model
        self.optimizer = optimizer
        self._sharded = bool(getattr(optimizer, "shard_optimizer_state", False))
        super().__init__(**kwargs)

    def _specs(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, shape, dtype) of each committed array, in order."""
        variables = list(self.model.variables)
        if self._sharded:
            return [_spec(v) for v in variables] + zero_saving.unsharded_specs(self.optimizer)
        return [_spec(v) for v in variables + list(self.optimizer.variables)]

    def _capture(self) -> tuple[list, dict]:
        sync_model_state(self.model)
        _, objects = super()._capture()
        arrays = [keras.ops.convert_to_numpy(v) for v in self.model.variables]
        if self._sharded:
            arrays += zero_saving.gather_everywhere(self.optimizer)
        else:
            arrays += [keras.ops.convert_to_numpy(v) for v in self.optimizer.variables]
        return arrays, objects

    def _capture_meta(self) -> tuple[list, None]:
        if not self._sharded:
            return super()._capture_meta()
        # Buffers for the commit another rank sends: gathering here would be a
        # collective that the sending rank does not join.
        return [np.empty(shape, dtype) for _, shape, dtype in self._specs()], None

    def _apply(self, arrays: list, objects: dict) -> None:
        sync_model_state(self.model)
        specs = self._specs()
        if len(arrays) != len(specs):
            raise ValueError(
                f"The committed state holds {len(arrays)} variables, this model and "
                f"optimizer {len(specs)}: the script must build the same model on "
                "every launch.")
        for (name, shape, _), value in zip(specs, arrays):
            if shape != np.shape(value):
                raise ValueError(
                    f"Variable {name!r} has shape {shape}, the committed state "
                    f"{np.shape(value)}: the script must build the same model on every "
                    "launch.")
        variables = list(self.model.variables)
        if not self._sharded:
            variables += list(self.optimizer.variables)
        for variable, value in zip(variables, arrays):
            variable.assign(value)
        if self._sharded:
            zero_saving.keep_share(self.optimizer, arrays[len(variables):])
        super()._apply(arrays, objects)


def _spec(variable) -> tuple[str, tuple[int, ...], str]:
    return (variable.path, tuple(int(d) for d in variable.shape),
            keras.backend.standardize_dtype(variable.dtype))
