"""Public path of the tensor layer's collectives (``keras_dist.tensor.ops``)."""

from keras_dist._vocab import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from keras_dist.tensor.compression import Compression
from keras_dist.tensor.exchange import (
    alltoall,
    grouped_allgather,
    grouped_reducescatter,
    reducescatter,
)
from keras_dist.tensor.ops import (
    COUNTERS,
    allgather,
    allgather_object,
    allreduce,
    barrier,
    broadcast,
    broadcast_,
    broadcast_object,
    broadcast_variables,
    grouped_allreduce,
)

__all__ = [
    "COUNTERS", "Adasum", "Average", "Compression", "Max", "Min", "Product", "ReduceOp", "Sum",
    "allgather", "allgather_object", "allreduce", "barrier", "broadcast", "broadcast_",
    "broadcast_object", "broadcast_variables", "grouped_allreduce",
    "alltoall", "grouped_allgather", "grouped_reducescatter", "reducescatter",
]
