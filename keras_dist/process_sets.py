"""Process sets: collectives among some of the job's ranks.

A ``ProcessSet`` names ranks of the job. Once registered, by
``init(process_sets=[...])`` or (with dynamic process sets) by
``add_process_set``, it has an id, and a collective given ``process_set=``
runs on the set's own group: its own communicator, split from the job's
private one, and its own CPU transport (inside a machine, its own
shared-memory segment). Collectives of different sets therefore never share
buffers and may run at the same time; ranks outside a set hold nothing for it
and never wait on it.

Registering and removing sets is collective over the whole job: every rank
makes the same calls in the same order, and the ranks check that they agree.
``ProcessSet.rank()`` is a rank within the set; ``root_rank`` arguments of
collectives stay job ranks (``keras_dist.rank()``).

Example:

```python
even, odd = kd.ProcessSet([0, 2]), kd.ProcessSet([1, 3])  # 4 ranks, every rank
kd.init(process_sets=[even, odd])
mine = even if even.included() else odd
total = kd.allreduce(x, op=kd.Sum, process_set=mine)  # sums over 2 ranks
```
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence

from keras_dist import transports
from keras_dist._runtime import context, process_groups
from keras_dist._runtime.context import Group, RegisteredSet

_HOW_TO_ENABLE = (
    "Set KERAS_DIST_DYNAMIC_PROCESS_SETS=1 (or HOROVOD_DYNAMIC_PROCESS_SETS=1) before "
    "`init()`, or call `init(process_sets=\"dynamic\")`"
)


def _is_mpi_object(value) -> bool:
    # mpi4py is imported only for a value that comes from it.
    return type(value).__module__.startswith("mpi4py")


def _checked_comm(comm):
    from mpi4py import MPI

    if not isinstance(comm, MPI.Comm):
        raise ValueError("`ProcessSet` takes a list of ranks or an mpi4py communicator. "
                         f"Received: {type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError("`ProcessSet` needs a communicator this rank belongs to. "
                         "Received: MPI.COMM_NULL")
    return comm


def _checked_ranks(value) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError("`ProcessSet` takes a list of ranks or an mpi4py communicator. "
                         f"Received: {value!r}")
    ranks = list(value)
    if any(isinstance(r, bool) or not isinstance(r, numbers.Integral) for r in ranks):
        raise ValueError(f"Process set ranks must be integers. Received: ranks={ranks!r}")
    ranks = sorted(int(r) for r in ranks)
    if ranks and ranks[0] < 0:
        raise ValueError(f"Process set ranks must be >= 0. Received: ranks={ranks}")
    repeated = sorted({r for r in ranks if ranks.count(r) > 1})
    if repeated:
        raise ValueError(f"Process set ranks must be distinct. Received: ranks={ranks} "
                         f"(repeated: {repeated})")
    return ranks



class ProcessSet:
    """Ranks of the job that run collectives together.

    Args:
        ranks_or_comm: the job ranks of the set (an iterable of ints, kept
            sorted), or an mpi4py communicator this rank belongs to, whose
            ranks form the set. Ranks of a split may each pass their own part
            (``COMM_WORLD.Split(color=rank % 2)`` gives two sets). A set made
            from a communicator is registered by ``init(comm,
            process_sets=[...])`` only.

    Attributes:
        ranks: the job ranks, ascending; None for a communicator until
            ``init`` has registered it.
        process_set_id: the id once registered (0: ``global_process_set``),
            else None.
        mpi_comm: the communicator the set was made from, or None.

    Raises:
        ValueError: ``ranks_or_comm`` is neither a list of non-negative,
            distinct integers nor an mpi4py communicator this rank is in.
    """

    def __init__(self, ranks_or_comm: Iterable[int] | object) -> None:
        self.process_set_id: int | None = None
        self.ranks: list[int] | None = None
        self.mpi_comm = None
        if _is_mpi_object(ranks_or_comm):
            self.mpi_comm = _checked_comm(ranks_or_comm)
        else:
            self.ranks = _checked_ranks(ranks_or_comm)

    def size(self) -> int | None:
        """The number of ranks in the set; None until it is registered."""
        if self.process_set_id is None:
            return None
        if self.process_set_id == 0:
            return context.get().size
        return len(_registered(context.get(), self).ranks)

    def rank(self) -> int | None:
        """This process's rank within the set; None until it is registered.

        Raises:
            ValueError: this process is not a member.
        """
        if self.process_set_id is None:
            return None
        return self._resolve(context.get()).rank

    def included(self) -> bool | None:
        """Whether this process is a member; None while the ranks are unknown."""
        if self.ranks is None:
            return None
        return context.get().rank in self.ranks

    def __repr__(self) -> str:
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    def _resolve(self, job: Group) -> Group:
        """This rank's group for the set (the job's for the global set).

        Raises:
            ValueError: the set is not registered, or this rank is not a member.
        """
        if self.process_set_id == 0:
            return job
        registered = _registered(job, self)
        if registered.group is None:
            raise ValueError(
                f"rank {job.rank} is not in process set {self.process_set_id} "
                f"(ranks {list(registered.ranks)}): only its members may call its collectives"
            )
        return registered.group


#: Every rank of the job (id 0); its ranks are filled in by ``init()``.
global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def add_process_set(process_set: ProcessSet | Iterable[int]) -> ProcessSet:
    """Registers a process set after ``init()`` and returns it, with its id.

    Collective over the whole job: every rank calls it with the same ranks,
    in the same order relative to other ``add_process_set`` and
    ``remove_process_set`` calls. Ids are the smallest free ones from 1.

    Args:
        process_set: a ``ProcessSet`` made from ranks, or the ranks.

    Raises:
        ValueError: dynamic process sets are not enabled, a set with these
            ranks is already registered (the global set included), a rank is
            outside the job, or the ranks called it with different ranks.
        NotImplementedError: ``process_set`` was made from a communicator.
    """
    job = context.get()
    if not job.config.dynamic_process_sets:
        raise ValueError(f"`add_process_set` needs dynamic process sets. {_HOW_TO_ENABLE}.")
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.ranks is None:
        raise NotImplementedError(
            "`add_process_set` takes ranks; a ProcessSet made from an MPI communicator is "
            f"registered by `init(comm, process_sets=[...])` only. Received: {process_set!r}"
        )
    ranks = tuple(process_set.ranks)
    _agree(job, "add_process_set", ranks)
    _check_ranks_in_job(job, ranks, "add_process_set")
    existing = _id_of(job, ranks)
    if existing is not None:
        raise ValueError(f"Attempted to add a duplicate process set: {process_set!r} has the "
                         f"ranks of process set {existing}")
    set_id = min(set(range(1, len(job.process_sets) + 2)) - set(job.process_sets))
    (group,) = _build(job, [(set_id, ranks)])
    job.process_sets[set_id] = RegisteredSet(ranks, group)
    process_set.process_set_id = set_id
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregisters a process set, closing its transport and communicators.

    Collective over the whole job, like ``add_process_set``. The object's
    ``process_set_id`` becomes None; it may be added again.

    Returns:
        True when the set was removed; False for the global set, a set that
        was never registered, or one already removed.

    Raises:
        ValueError: dynamic process sets are not enabled, or the ranks
            removed different sets.
    """
    job = context.get()
    if not isinstance(process_set, ProcessSet):
        raise ValueError("`remove_process_set` takes a keras_dist.ProcessSet. "
                         f"Received: {process_set!r}")
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0:
        return False
    if not job.config.dynamic_process_sets:
        raise ValueError(f"`remove_process_set` needs dynamic process sets. {_HOW_TO_ENABLE}.")
    _agree(job, "remove_process_set", set_id)
    process_set.process_set_id = None
    registered = job.process_sets.pop(set_id, None)
    if registered is None:
        return False
    if registered.group is not None:
        registered.group.close()
    return True


def by_id(process_set_id: int) -> ProcessSet:
    """The registered process set numbered ``process_set_id`` (0: the global set).

    Raises:
        ValueError: ``process_set_id`` is not an integer or not registered.
    """
    if isinstance(process_set_id, bool) or not isinstance(process_set_id, numbers.Integral):
        raise ValueError("`process_set_id` must be an integer. "
                         f"Received: process_set_id={process_set_id!r}")
    if process_set_id == 0:
        return global_process_set
    found = ProcessSet([])
    found.process_set_id = int(process_set_id)
    found.ranks = list(_registered(context.get(), found).ranks)
    return found


def registered() -> dict[int, list[int]]:
    """Every registered process set's ranks by id, the global set (0) included."""
    job = context.get()
    return {0: list(job.ranks),
            **{i: list(job.process_sets[i].ranks) for i in sorted(job.process_sets)}}


# ---------------------------------------------------------------------------
# Used by ``init()`` and ``shutdown()``.


def parse_init_argument(process_sets) -> tuple[list[ProcessSet], bool]:
    """``init``'s ``process_sets`` as (the sets to register now, whether dynamic).

    Raises:
        ValueError: it is neither None, ``"dynamic"`` nor a list of ``ProcessSet``.
    """
    if process_sets is None:
        return [], False
    if isinstance(process_sets, str):
        if process_sets.lower() == "dynamic":
            return [], True
        raise ValueError('`process_sets` must be a list of ProcessSet or "dynamic". '
                         f"Received: process_sets={process_sets!r}")
    if not isinstance(process_sets, Iterable):
        raise ValueError('`process_sets` must be a list of ProcessSet or "dynamic". '
                         f"Received: {type(process_sets).__name__}")
    entries = list(process_sets)
    for index, entry in enumerate(entries):
        if not isinstance(entry, ProcessSet):
            raise ValueError(f"`process_sets` must hold ProcessSet objects. Received: "
                             f"{type(entry).__name__} at position {index}")
        if entry is global_process_set:
            raise ValueError("`process_sets` must not hold `global_process_set`: it is "
                             f"always registered. Received it at position {index}")
    return entries, False


def register_at_init(job: Group, entries: Sequence[ProcessSet], user_comm) -> None:
    """Registers ``entries`` (ids 1, 2, ... in list order) and fills in the global set.

    Collective over the job. Each entry made from a communicator may stand for
    several sets (one per part of a split): they get consecutive ids, in the
    order of their lowest rank.

    Raises:
        ValueError: the ranks passed different lists, an entry is empty,
            names ranks outside the job, or repeats another entry or the
            global set (raised on every rank).
    """
    global_process_set.ranks = list(job.ranks)
    global_process_set.mpi_comm = user_comm
    if not entries:
        return
    mine = [_ranks_here(job, entry) for entry in entries]
    everyone = job.comm.allgather(mine)
    table = _init_table(job, entries, everyone)
    groups = _build(job, table)
    for (set_id, ranks), group in zip(table, groups):
        job.process_sets[set_id] = RegisteredSet(ranks, group)
    ids = {ranks: set_id for set_id, ranks in table}
    for entry, ranks in zip(entries, mine):
        entry.process_set_id = ids[ranks]
        entry.ranks = list(ranks)


def close_all(job: Group) -> None:
    """Closes and forgets every registered set (collective over the job)."""
    for set_id in sorted(job.process_sets):
        group = job.process_sets.pop(set_id).group
        if group is not None:
            group.close()


# ---------------------------------------------------------------------------
# Helpers.


def _problem_with_ranks(job: Group, ranks: Sequence[int]) -> str | None:
    if not ranks:
        return "a process set needs at least one rank. Received: ranks=[]"
    outside = [r for r in ranks if r >= job.size]
    if outside:
        return (f"process set ranks must be in [0, {job.size}) (the job's size). "
                f"Received: ranks={list(ranks)}")
    return None


def _check_ranks_in_job(job: Group, ranks: Sequence[int], call: str) -> None:
    problem = _problem_with_ranks(job, ranks)
    if problem:
        raise ValueError(f"`{call}`: {problem}")


def _id_of(job: Group, ranks: tuple[int, ...]) -> int | None:
    """The id of the registered set with ``ranks`` (0 for the job's), or None."""
    if ranks == job.ranks:
        return 0
    return next((i for i, r in job.process_sets.items() if r.ranks == ranks), None)


def _registered(job: Group, process_set: ProcessSet) -> RegisteredSet:
    found = job.process_sets.get(process_set.process_set_id)
    if found is None:
        raise ValueError(
            f"{process_set!r} is not registered (call add_process_set or "
            f"init(process_sets=...)). Registered ids: {[0, *sorted(job.process_sets)]}"
        )
    return found


def _agree(job: Group, call: str, description) -> None:
    """Checks that every rank made this call with an equal ``description``."""
    everyone = job.comm.allgather(description)
    if any(d != everyone[0] for d in everyone):
        detail = "; ".join(f"rank {r}: {d}" for r, d in enumerate(everyone))
        raise ValueError(f"`{call}` must be called by every rank with the same arguments, in "
                         f"the same order. Received: {detail}")


def _ranks_here(job: Group, entry: ProcessSet) -> tuple[int, ...] | str:
    """The job ranks of ``entry`` as this rank sees them, or what is wrong."""
    if entry.mpi_comm is None:
        return tuple(entry.ranks)
    return process_groups.job_ranks_of(job, entry.mpi_comm)


def _init_table(job: Group, entries: Sequence[ProcessSet],
                everyone: list[list]) -> list[tuple[int, tuple[int, ...]]]:
    """(id, ranks) of every set that ``init`` registers, from every rank's view.

    Every rank computes this from the same ``everyone``, so all raise alike.
    """
    counts = [len(view) for view in everyone]
    if len(set(counts)) > 1:
        raise ValueError("`init(process_sets=...)` must get the same list on every rank. "
                         f"Received lists of lengths {counts} on ranks 0..{job.size - 1}")
    table: list[tuple[int, tuple[int, ...]]] = []
    for index, entry in enumerate(entries):
        views = [view[index] for view in everyone]
        for rank, view in enumerate(views):
            problem = view if isinstance(view, str) else _problem_with_ranks(job, view)
            if problem:
                raise ValueError(f"`init`: process_sets entry number {index} on rank {rank}: "
                                 f"{problem}")
        if entry.mpi_comm is None and len(set(views)) > 1:
            detail = "; ".join(f"rank {r}: {list(v)}" for r, v in enumerate(views))
            raise ValueError(f"`init`: process_sets entry number {index} must have the same "
                             f"ranks on every rank. Received: {detail}")
        for rank, view in enumerate(views):
            disagree = [r for r in view if views[r] != view]
            if rank in view and disagree:
                raise ValueError(
                    f"`init`: process_sets entry number {index}: the communicators do not "
                    f"agree on their members. Received: rank {rank} sees {list(view)}, rank "
                    f"{disagree[0]} sees {list(views[disagree[0]])}")
        for ranks in sorted(set(views)):
            known = [i for i, r in table if r == ranks]
            if ranks == job.ranks or known:
                raise ValueError(
                    f"`init`: process_sets entry number {index} is a duplicate of process "
                    f"set {known[0] if known else 0}: ranks {list(ranks)}")
            table.append((len(table) + 1, ranks))
    return table


def _build(job: Group, table: Sequence[tuple[int, tuple[int, ...]]]) -> list[Group | None]:
    """Each set's group on its members (None elsewhere), each with its own CPU
    transport (``process_groups.make_groups``; collective over the job)."""
    return process_groups.make_groups(job, table, transports.cpu_transport)
