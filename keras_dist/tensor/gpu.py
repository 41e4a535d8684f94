"""GPU values (cupy arrays) through the group's GPU data plane.

The tensor layer hands cupy values here, already validated; they are fused
by dtype on the device, and each fused buffer is reduced by the transport
``KERAS_DIST_GPU_OPERATIONS`` chooses (``transports.gpu_transport``): NCCL,
without a trip through host memory, or the CPU transport with the buffer
staged in host memory. The result stays on the device either way.
"""

from __future__ import annotations

import collections

from keras_dist import _vocab, transports
from keras_dist._runtime import context
from keras_dist.tensor import fusion


def grouped_allreduce(values: list, op: _vocab.ReduceOp, prescale: float, postscale: float,
                      compression, counters: collections.Counter) -> list:
    """``values`` (cupy arrays) reduced across ranks; cupy arrays on the same device out."""
    group = context.get()
    compressed, contexts = zip(*(compression.compress(v) for v in values))
    if group.size == 1:
        scale = prescale * postscale
        results = [v if scale == 1.0 else v * scale for v in compressed]
    else:
        import cupy

        transport = transports.gpu_transport(group)
        results = list(compressed)
        threshold = group.config.fusion_threshold_bytes
        for bucket in fusion.plan_buckets(compressed, threshold):
            members = [compressed[i] for i in bucket]
            flat = cupy.concatenate([m.ravel() for m in members])
            if prescale != 1.0:
                flat *= prescale
            transport.allreduce(flat, _vocab.TRANSPORT_OPS[op])
            counters["allreduce"] += 1
            _vocab.finish_reduction(flat, op, group.size, postscale)
            offset = 0
            for index, member in zip(bucket, members):
                results[index] = flat[offset : offset + member.size].reshape(member.shape)
                offset += member.size
    return [compression.decompress(r, c) for r, c in zip(results, contexts)]
