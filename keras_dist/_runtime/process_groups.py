"""The communicators and groups of process sets (MPI's side of ``process_sets``).

``keras_dist.process_sets`` keeps the public API and the bookkeeping; this
module splits the job's communicator, lays out each set's topology and hands
the set's members to the CPU transport factory it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from keras_dist._runtime.context import Group, topology
from keras_dist.errors import TransportError


def job_ranks_of(job: Group, comm) -> tuple[int, ...] | str:
    """The job ranks of the processes of ``comm`` (sorted), or what is wrong."""
    from mpi4py import MPI

    group, job_group = comm.Get_group(), job.comm.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), job_group)
    finally:
        group.Free()
        job_group.Free()
    if MPI.UNDEFINED in ranks:
        return "its communicator holds processes outside the job's communicator"
    return tuple(sorted(ranks))


def make_groups(job: Group, table: Sequence[tuple[int, tuple[int, ...]]],
                cpu_transport: Callable) -> list[Group | None]:
    """Makes each set's group on its members (None elsewhere).

    Collective over the job: every rank takes part in each set's split of the
    job's communicator; then the set's members make its topology and, with
    ``cpu_transport(config, comm, local_comm, cross_comm, rank_names=...)``,
    its transport among themselves (the transports raise on every member of
    a set). A failure on any rank is raised on every rank, once what was made
    is closed.

    Args:
        job: the job's group.
        table: ``(set id, job ranks)`` of each set to make, the same on every rank.
        cpu_transport: makes a group's CPU transport (``transports.cpu_transport``).
    """
    from mpi4py import MPI

    groups: list[Group | None] = []
    problem = None
    for set_id, ranks in table:
        member = job.rank in ranks
        comm = job.comm.Split(0 if member else MPI.UNDEFINED, job.rank)
        group = None
        if member:
            try:
                group = _member_group(job, set_id, ranks, comm, cpu_transport)
            except Exception as exc:  # raised on every rank below
                problem = problem or (f"process set {set_id} (ranks {list(ranks)}) on rank "
                                      f"{job.rank}: {type(exc).__name__}: {exc}")
        groups.append(group)
    problems = [p for p in job.comm.allgather(problem) if p]
    if problems:
        for group in groups:
            if group is not None:
                group.close()
        raise TransportError(f"Process sets could not be made: {'; '.join(problems)}")
    return groups


def _member_group(job: Group, set_id: int, ranks: tuple[int, ...], comm,
                  cpu_transport: Callable) -> Group:
    """The group of a set on one of its members; collective over ``comm``."""
    fields = topology(comm, job.config)
    try:
        transport = cpu_transport(job.config, comm, fields["local_comm"], fields["cross_comm"],
                                  rank_names=ranks)
    except BaseException:
        for made in (fields["cross_comm"], fields["local_comm"], comm):
            made.Free()
        raise
    return Group(config=job.config, transport=transport, ranks=ranks,
                 process_set_id=set_id, **fields)
