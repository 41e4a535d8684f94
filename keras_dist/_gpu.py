"""GPU values (cupy arrays) through the NCCL transport.

The tensor layer hands cupy values here; they are fused by dtype on the
device and reduced by NCCL without a trip through host memory.
"""

from __future__ import annotations

import numpy as np

from keras_dist import _context, _dtypes, fusion


def grouped_allreduce(values: list, op, prescale: float, postscale: float, compression) -> list:
    from keras_dist import ops

    group = _context.get()
    compressed, contexts = zip(*(compression.compress(v) for v in values))
    for value in compressed:
        _dtypes.dtype_code(value.dtype)
    if group.size == 1:
        scale = prescale * postscale
        results = [v if scale == 1.0 else v * scale for v in compressed]
    else:
        import cupy

        transport = _context.gpu_transport()
        results = list(compressed)
        threshold = group.config.fusion_threshold_bytes
        for bucket in fusion.plan_buckets(compressed, threshold):
            members = [compressed[i] for i in bucket]
            flat = cupy.concatenate([m.ravel() for m in members])
            if prescale != 1.0:
                flat *= prescale
            transport.allreduce(flat, ops._TRANSPORT_OPS[op])
            ops.COUNTERS["allreduce"] += 1
            integer = not _dtypes.is_half(flat.dtype) and not np.issubdtype(flat.dtype,
                                                                            np.floating)
            if op is ops.ReduceOp.AVERAGE and integer:
                flat //= group.size
            else:
                scale = postscale / group.size if op is ops.ReduceOp.AVERAGE else postscale
                if scale != 1.0:
                    flat *= scale
            offset = 0
            for index, member in zip(bucket, members):
                results[index] = flat[offset : offset + member.size].reshape(member.shape)
                offset += member.size
    return [compression.decompress(r, c) for r, c in zip(results, contexts)]
