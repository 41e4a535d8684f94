"""GPU values (cupy arrays) through the NCCL transport.

The tensor layer hands cupy values here; they are fused by dtype on the
device and reduced by NCCL without a trip through host memory.
"""

from __future__ import annotations

import collections

from keras_dist import _vocab, transports
from keras_dist._runtime import context
from keras_dist.tensor import fusion


def grouped_allreduce(values: list, op: _vocab.ReduceOp, prescale: float, postscale: float,
                      compression, counters: collections.Counter) -> list:
    group = context.get()
    compressed, contexts = zip(*(compression.compress(v) for v in values))
    for value in compressed:
        _vocab.dtype_code(value.dtype)
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
