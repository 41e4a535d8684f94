"""How a grouped allreduce runs: its plan (buckets, the names peers check,
where results go), cached per call, and the finishing of a bucket's
reduction (the op's last step, the scales, ranks that have joined).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from keras_dist import _vocab
from keras_dist._vocab import Average, ReduceOp
from keras_dist.errors import CollectiveMismatchError
from keras_dist.tensor import checks, fusion


@functools.lru_cache(maxsize=1024)
def describe(prefix: str, members: tuple, group_length: int) -> str:
    """The name a transport checks ranks agree on: the call and its bucket's shapes.

    Cached: training steps repeat the same calls.
    """
    shapes = " ".join(f"{np.dtype(d).name}{list(shape)}" for shape, d in members)
    return f"{prefix} [{len(members)} of {group_length} tensors: {shapes}]"


class PlannedBucket(NamedTuple):
    """One fused message of a grouped allreduce."""

    #: Positions of its arrays in the call.
    indices: list[int]
    dtype: np.dtype
    #: The name peers check (``describe``).
    described: str


class AllreducePlan(NamedTuple):
    """How a grouped allreduce of arrays of given shapes and dtypes runs."""

    buckets: list[PlannedBucket]
    #: Where each result starts in the aligned region of results
    #: (``fusion.aligned_offsets``), and the region's size.
    offsets: list[int]
    total: int
    #: The arrays' bytes.
    nbytes: int


#: Recent grouped allreduces' plans by (name, op, fusion threshold, every
#: array's shape and dtype): a training step makes the same call every step.
_PLANS: dict[tuple, AllreducePlan] = {}
_MAX_PLANS = 64


def allreduce_plan(arrays: list[np.ndarray], op: ReduceOp, name: str,
                    threshold: int) -> AllreducePlan:
    """``arrays``' plan (``_PLANS``), made and checked the first time."""
    key = (name, op, threshold, *[(a.shape, a.dtype) for a in arrays])
    plan = _PLANS.get(key)
    if plan is None:
        checks.check_allreduce_inputs([a.dtype for a in arrays])
        prefix = f"{name} {op.value}"
        buckets = [PlannedBucket(bucket, arrays[bucket[0]].dtype,
                                 describe(prefix, tuple((arrays[i].shape, arrays[i].dtype.str)
                                                         for i in bucket), len(arrays)))
                   for bucket in fusion.plan_buckets(arrays, threshold)]
        nbytes = [a.nbytes for a in arrays]
        plan = AllreducePlan(buckets, *fusion.aligned_offsets(nbytes), sum(nbytes))
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def unpack_finished(flat: np.ndarray, members: list[np.ndarray], results: list[np.ndarray],
                     op: ReduceOp, size: int, postscale: float) -> None:
    """Writes the transport's reduction ``flat`` of ``members`` into ``results``
    as ``op``'s result (times ``postscale``)."""
    dtype = members[0].dtype
    scale = _vocab.finishing_scale(op, dtype, size, postscale)
    fusion.unpack(flat, members, 1.0 if scale is None else _vocab.typed_factor(scale, dtype),
                  out=results)
    if scale is None:
        for result in results:
            _vocab.finish_reduction(result, op, size, postscale)


def allreduce_parts(transport, members: list[np.ndarray], results: list[np.ndarray],
                     op: ReduceOp, described: str, size: int) -> None:
    """The allreduce of one bucket by ``transport.allreduce_parts`` into ``results``."""
    code = _vocab.TRANSPORT_OPS[op]
    try:
        transport.allreduce_parts(members, results, code, op is Average, described)
    except CollectiveMismatchError as error:
        parts_mismatched(transport, error, members, results, op, described, size)


def parts_mismatched(transport, error: CollectiveMismatchError, members: list[np.ndarray],
                      results: list[np.ndarray], op: ReduceOp, described: str,
                      size: int) -> None:
    """After ``allreduce_parts`` of a bucket raised ``error``: the bucket's result
    with the joined ranks' part when ranks have joined (as the general path),
    else ``error`` raised (``transport.allreduce_mismatched``)."""
    flat = np.empty(sum(a.size for a in members), members[0].dtype)
    fusion.pack(members, flat)
    unpack_finished(transport.allreduce_mismatched(error, flat, _vocab.TRANSPORT_OPS[op],
                                                    described),
                     members, results, op, size, 1.0)
