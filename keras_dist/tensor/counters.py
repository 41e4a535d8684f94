"""``COUNTERS``: what this process handed to its transports, by collective.

A leaf of the tensor layer (it imports nothing), so that every module of the
layer counts in the same dict; ``keras_dist.ops.COUNTERS`` is this dict.
"""

from __future__ import annotations

#: Transport calls made by this process, by collective ("allreduce", ...).
#: One fused bucket is one call. Tests count collectives with it.
#: "gpu_allreduce": fused device buckets handed to the GPU data plane (also
#: counted in "allreduce"); "device_to_host": GPU values (or fused device
#: buckets, when a GPU data plane stages them) that keras_dist copied to host
#: memory. A plain dict: the native calls count in it too.
COUNTERS: dict[str, int] = dict.fromkeys(
    ("allreduce", "allgather", "broadcast", "alltoall", "barrier", "broadcast_object",
     "allgather_object", "gpu_allreduce", "device_to_host"), 0)
