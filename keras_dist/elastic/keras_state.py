"""``KerasState``: a Keras model and its optimizer as elastic state."""

from __future__ import annotations

import keras
import numpy as np

from keras_dist._keras.backends import sync_model_state
from keras_dist.elastic.state import ObjectState


class KerasState(ObjectState):
    """A model's and its optimizer's variables, plus any keyword values
    (Horovod's ``hvd.elastic.KerasState``).

    Args:
        model: a built Keras model.
        optimizer: its optimizer; defaults to ``model.optimizer``. Built here
            when it is not yet, so that its variables are part of every commit.
        **kwargs: picklable values kept with it, as attributes (``epoch=0,
            batch=0`` for the elastic callbacks).

    Raises:
        ValueError: the model is not built, or has no optimizer and none is given,
            or the optimizer shards its state (``shard_optimizer_state=True``).
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
        if getattr(optimizer, "shard_optimizer_state", False):
            # A commit would hold each rank's own share, which neither survives the
            # loss of that rank nor re-shards at another number of ranks.
            raise ValueError(
                "KerasState cannot commit a sharded optimizer state yet: pass "
                "shard_optimizer_state=False to DistributedOptimizer for an elastic run, "
                "or resume with BackupAndRestore or kd.save_model / kd.load_model. "
                "Received: shard_optimizer_state=True")
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        self.model = model
        self.optimizer = optimizer
        super().__init__(**kwargs)

    def _variables(self) -> list:
        return list(self.model.variables) + list(self.optimizer.variables)

    def _capture(self) -> tuple[list, dict]:
        sync_model_state(self.model)
        _, objects = super()._capture()
        return [keras.ops.convert_to_numpy(v) for v in self._variables()], objects

    def _apply(self, arrays: list, objects: dict) -> None:
        sync_model_state(self.model)
        variables = self._variables()
        if len(arrays) != len(variables):
            raise ValueError(
                f"The committed state holds {len(arrays)} variables, this model and "
                f"optimizer {len(variables)}: the script must build the same model on "
                "every launch.")
        for variable, value in zip(variables, arrays):
            if tuple(variable.shape) != np.shape(value):
                raise ValueError(
                    f"Variable {variable.path!r} has shape {tuple(variable.shape)}, the "
                    f"committed state {np.shape(value)}: the script must build the same "
                    "model on every launch.")
            variable.assign(value)
        super()._apply(arrays, objects)
