"""Where a RayExecutor's ranks go: placement-group bundles, rank order, GPUs.
Pure arithmetic on what Ray reports; imports no Ray, tested without it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one worker landed: its node's address, its machine, Ray's GPUs for it."""

    ip: str
    hostname: str
    gpu_ids: tuple[str, ...]


def bundle(cpus: float, gpus: float) -> dict[str, float]:
    """One placement-group bundle."""
    resources = {"CPU": cpus}
    if gpus:
        resources["GPU"] = gpus
    return resources


def rank_order(node_of_bundle: Mapping[int, str], per_bundle: int) -> list[int]:
    """The bundle of each rank: ranks of one node consecutive, nodes in the
    order of their first bundle (MPI numbers local ranks by rank within a
    machine), ``per_bundle`` ranks in each bundle."""
    first: dict[str, int] = {}
    for index in sorted(node_of_bundle):
        first.setdefault(node_of_bundle[index], index)
    order = sorted(node_of_bundle, key=lambda index: (first[node_of_bundle[index]], index))
    return [index for index in order for _ in range(per_bundle)]


def visible_gpus(slots: Sequence[Slot]) -> list[str]:
    """Each rank's ``CUDA_VISIBLE_DEVICES``: the GPUs of every rank of its
    machine, in rank order, so index ``local_rank`` is its own (as Horovod did)."""
    by_host: dict[str, list[str]] = {}
    for slot in slots:
        listed = by_host.setdefault(slot.hostname, [])
        listed += [gpu for gpu in slot.gpu_ids if gpu not in listed]
    return [",".join(by_host[slot.hostname]) for slot in slots]
