"""keras_dist: Horovod-style data-parallel training for Keras 3.

Example:

```python
import keras_dist as kd

kd.init()
model.compile(optimizer=kd.DistributedOptimizer(keras.optimizers.SGD(0.01 * kd.size())),
              loss="sparse_categorical_crossentropy")
model.fit(x, y, callbacks=[kd.callbacks.BroadcastGlobalVariablesCallback(0),
                           kd.callbacks.MetricAverageCallback()],
          verbose=1 if kd.rank() == 0 else 0)
```
Launch with ``kdrun -np 4 python train.py``.
"""

from __future__ import annotations

from keras_dist._capabilities import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
)
from keras_dist._lifecycle import init, shutdown
from keras_dist._runtime.context import get as _get
from keras_dist._runtime.context import is_initialized
from keras_dist._runtime.timeline import start_timeline, stop_timeline
from keras_dist.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    KerasDistError,
    NotInitializedError,
    PeerFailureError,
    RendezvousError,
    StallWarning,
    TransportError,
)
from keras_dist.ops import (
    Adasum,
    Average,
    Compression,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    allgather,
    allgather_object,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    broadcast_object,
    broadcast_variables,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from keras_dist.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from keras_dist.tensor.join import join

__version__ = "0.1.0"

# The Keras layer imports Keras (and so its backend, e.g. TensorFlow), which
# takes seconds: it loads on first use, so the collectives alone stay light.
_LAZY = {
    "DistributedOptimizer": ("keras_dist._keras.optimizer", "DistributedOptimizer"),
    "BroadcastGlobalVariablesHook": (
        "keras_dist._keras.session_hook", "BroadcastGlobalVariablesHook"),
    "PartialDistributedOptimizer": (
        "keras_dist._keras.optimizer", "PartialDistributedOptimizer"),
    "DistributedGradientTape": ("keras_dist._keras.gradient_tape", "DistributedGradientTape"),
    "PartialDistributedGradientTape": (
        "keras_dist._keras.gradient_tape", "PartialDistributedGradientTape"),
    "load_model": ("keras_dist._keras.saving", "load_model"),
    "save_model": ("keras_dist._keras.saving", "save_model"),
    "shard": ("keras_dist.data", "shard"),
    "SyncBatchNormalization": ("keras_dist._keras.sync_batch_norm", "SyncBatchNormalization"),
    "callbacks": ("keras_dist.callbacks", None),
    "elastic": ("keras_dist.elastic", None),
    "size_op": ("keras_dist.tensor.tf.ops", "size_op"),
    "rank_op": ("keras_dist.tensor.tf.ops", "rank_op"),
    "local_size_op": ("keras_dist.tensor.tf.ops", "local_size_op"),
    "local_rank_op": ("keras_dist.tensor.tf.ops", "local_rank_op"),
    "broadcast_global_variables": ("keras_dist.tensor.tf.functions", "broadcast_global_variables"),
    "process_set_included_op": ("keras_dist.tensor.tf.ops", "process_set_included_op"),
    "broadcast_object_fn": ("keras_dist.tensor.tf.functions", "broadcast_object_fn"),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'keras_dist' has no attribute {name!r}")
    import importlib

    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def size() -> int:
    """The number of ranks in the job."""
    return _get().size


def rank() -> int:
    """This process's rank, in [0, size())."""
    return _get().rank


def local_size() -> int:
    """The number of ranks on this machine."""
    return _get().local_size


def local_rank() -> int:
    """This process's rank among the ranks on its machine."""
    return _get().local_rank


def cross_size() -> int:
    """The number of machines (ranks sharing this process's local rank)."""
    return _get().cross_size


def cross_rank() -> int:
    """This machine's index among the machines of the job."""
    return _get().cross_rank


def is_homogeneous() -> bool:
    """Whether every machine of the job runs the same number of ranks."""
    return _get().homogeneous


__all__ = [
    "Adasum", "Average", "BroadcastGlobalVariablesHook", "CollectiveMismatchError",
    "CollectiveTimeoutError", "Compression",
    "DistributedGradientTape", "DistributedOptimizer", "KerasDistError", "Max", "Min",
    "NotInitializedError", "PartialDistributedGradientTape", "PartialDistributedOptimizer",
    "PeerFailureError", "ProcessSet", "Product", "ReduceOp", "RendezvousError", "StallWarning",
    "Sum",
    "SyncBatchNormalization", "TransportError", "add_process_set", "allgather",
    "allgather_object", "allreduce", "alltoall", "barrier", "broadcast", "broadcast_",
    "broadcast_global_variables", "broadcast_object", "broadcast_object_fn",
    "broadcast_variables", "callbacks", "ccl_built", "cross_rank", "cross_size", "cuda_built",
    "ddl_built", "elastic", "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather",
    "grouped_allreduce", "grouped_reducescatter", "init", "is_homogeneous", "is_initialized",
    "join", "load_model", "local_rank", "local_rank_op", "local_size", "local_size_op",
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built",
    "process_set_included_op", "rank", "rank_op", "reducescatter", "remove_process_set",
    "rocm_built", "save_model", "shard", "shutdown", "size", "size_op", "start_timeline",
    "stop_timeline",
]
