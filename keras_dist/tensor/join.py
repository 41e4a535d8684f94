"""``join``: the public entry to uneven data (``transports/joinable.py`` does the work)."""

from __future__ import annotations

from keras_dist._runtime import context
from keras_dist.errors import TransportError


def join(process_set=None) -> int:
    """Declares that this rank has no more data, and waits for the others.

    Until every rank of the group has called ``join``, the other ranks'
    allreduces go on with this rank contributing nothing: zeros to a sum (an
    ``Average`` still divides by the group's full size, as in Horovod), the
    op's identity to ``Min``, ``Max`` and ``Product``. Any other collective
    called while ranks have joined raises ``CollectiveMismatchError`` on the
    ranks that called it, saying which ranks joined.

    Args:
        process_set: the group to join (default: the whole job).

    Returns:
        The job rank that joined last (the highest of them when several
        joined at once), a valid ``root_rank`` for the group's broadcasts.

    Raises:
        TransportError: GPU values of the group are reduced by NCCL, which
            cannot go on without every rank; the other ranks raise too, at
            their next GPU collective or in the one they wait in
            (``KERAS_DIST_GPU_OPERATIONS=mpi`` stages GPU values through
            host memory, where ``join`` works).
    """
    group = context.group_for(process_set)
    if group.size == 1:
        return group.ranks[0]
    if group.gpu_transport is not None:
        reason = group.gpu_transport.refuse_join(group.rank)
        if reason is not None:
            raise TransportError(f"join() cannot run on rank {group.ranks[group.rank]}: "
                                 f"{reason}.")
    return group.ranks[group.transport.join()]
