"""BroadcastGlobalVariablesHook: every rank of a TF1 session starts from the root's variables."""

from __future__ import annotations

import tensorflow as tf

from keras_dist._runtime import context
from keras_dist.tensor import checks
from keras_dist.tensor.tf.functions import broadcast_global_variables


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """A ``tf.compat.v1.train.SessionRunHook`` that broadcasts the global
    variables from ``root_rank`` once the session is created.

    ``begin`` builds the broadcast of every global variable (model, optimizer
    slots, ``global_step``) in the graph the session will run; once the
    session exists (initialised, or restored from a checkpoint, by
    ``MonitoredTrainingSession`` on the ranks that have one) it runs once,
    so every rank starts from the root's values.

    Args:
        root_rank: the rank whose variables every rank takes.
        device: the device the broadcast's ops are built on (TensorFlow's
            device string; ``""`` lets TensorFlow place them).

    Example:

    ```python
    hooks = [kd.BroadcastGlobalVariablesHook(0),
             tf.compat.v1.train.StopAtStepHook(last_step=1000 // kd.size())]
    with tf.compat.v1.train.MonitoredTrainingSession(
            checkpoint_dir="./checkpoints" if kd.rank() == 0 else None,
            hooks=hooks) as session:
        while not session.should_stop():
            session.run(train_op)
    ```
    """

    def __init__(self, root_rank: int, device: str = ""):
        super().__init__()
        checks.check_root(root_rank, context.get())
        if not isinstance(device, str):
            raise ValueError("`device` must be a TensorFlow device string. "
                             f"Received: device={device!r}")
        self.root_rank = int(root_rank)
        self.device = device
        self.broadcast_op = None

    def begin(self):
        graph = tf.compat.v1.get_default_graph()
        if self.broadcast_op is None or self.broadcast_op.graph is not graph:
            with tf.device(self.device):
                self.broadcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        session.run(self.broadcast_op)
