"""The hierarchical transport: shared memory inside each machine, MPI between them.

Each collective runs in three steps: the shm engine among the ranks of each
machine, the MPI transport among the machines' leaders (local rank 0 of
each), and the engine again to hand the leaders' result to the others. Every
wait is bounded: the leaders wait in ``MpiTransport``'s checked path (a
``Waiter`` with liveness checks, stall warnings and the timeout), the other
ranks in the engine.

Before any data moves, every rank of every machine reaches the same
verdict on the call: the ranks of each machine compare their calls (the
engine's header-only step), the leaders compare their machines' calls and
verdicts (``MpiTransport.agree``), and a leader that learns of a mismatch
anywhere hands the verdict to its machine in place of the collective's first
step (``ShmTransport.raise_mismatch``). So a mismatch, inside one machine or
between machines, raises ``CollectiveMismatchError`` with the same message
on every rank, moves no data, and leaves every level usable.

Ranks are numbered as in the group's communicator; at construction every
rank checks that its communicators describe one consistent layout (each
group rank once, on one machine, at one local rank).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence

import numpy as np

from keras_dist import _vocab, errors
from keras_dist._config import Config
from keras_dist.transports.base import Transport, counts_in_bytes
from keras_dist.transports.mpi import MpiTransport
from keras_dist.transports.shm import ShmTransport


class HierarchicalTransport(Transport):
    """Collectives over several machines: shm inside each, MPI among leaders.

    Args:
        comm: the group's communicator; its ranks are the transport's.
        local_comm: the ranks of ``comm`` on this machine.
        cross_comm: the ranks of ``comm`` with this rank's local rank, one per
            machine (on local rank 0: every machine's leader).
        config: the settings (``Config``).

    Raises:
        TransportError: the communicators disagree about who runs where
            (raised on every rank), or the shm transport cannot be made.
    """

    name = "hierarchical"

    def __init__(self, comm, local_comm, cross_comm, config: Config) -> None:
        super().__init__()
        from mpi4py import MPI

        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        local_rank = local_comm.Get_rank()
        self._is_leader = local_rank == 0
        node_ranks = local_comm.allgather(self.rank)
        machines = node = None
        if self._is_leader:
            machines, node = cross_comm.allgather(node_ranks), cross_comm.Get_rank()
        machines, node = local_comm.bcast((machines, node), root=0)
        everyone = comm.allgather(
            (MPI.COMM_WORLD.Get_rank(), socket.gethostname(), node, local_rank)
        )
        problem = _layout_problem(machines, everyone)
        if problem:
            raise errors.TransportError(f"hierarchical transport unavailable: {problem}")
        #: Group ranks of each machine's local ranks, and (machine, local rank) of each rank.
        self._members: list[list[int]] = machines
        self._where = {g: (m, lr) for m, ms in enumerate(machines) for lr, g in enumerate(ms)}
        self._node = node
        self._local = ShmTransport(local_comm, config, group_ranks=node_ranks)
        #: The leaders' transport (MPI, bounded waits), on leaders only.
        self._leaders: MpiTransport | None = None
        self._leaders_comm = None
        if self._is_leader:
            self._leaders_comm = cross_comm.Dup()
            same_host = self._leaders_comm.Split_type(MPI.COMM_TYPE_SHARED, key=node)
            try:
                self._leaders = MpiTransport(self._leaders_comm, same_host, config,
                                             rank_names=[ms[0] for ms in machines])
            finally:
                same_host.Free()
        #: The shm transport's single-copy status on this machine.
        self.single_copy_status = self._local.single_copy_status

    # -- collectives -------------------------------------------------------

    def allreduce(self, buf: np.ndarray, op: int, name: str | None = None,
                  send: np.ndarray | None = None) -> None:
        _vocab.dtype_code(buf.dtype)  # an unsupported dtype raises before any wait
        self._settle(
            "allreduce",
            {"dtype": buf.dtype.name, "count": buf.size, "op": _vocab.OP_NAMES.get(op, op),
             "name": name},
            lambda: self._local.check("allreduce", nbytes=buf.nbytes, dtype=buf.dtype, op=op,
                                      name=name),
        )
        if _vocab.is_half(buf.dtype):
            # Both levels reduce in float32 and the result is rounded once, as
            # on one machine (the wider messages cost twice the bytes).
            wide = (buf if send is None else send).astype(np.float32)
            self._reduce(wide, op, name, None)
            buf[...] = wide.astype(buf.dtype)
        else:
            self._reduce(buf, op, name, send)

    def _reduce(self, buf: np.ndarray, op: int, name: str | None,
                send: np.ndarray | None) -> None:
        """Reduces inside the machine, then among the leaders, then hands back."""
        self._local.allreduce(buf, op, name, send)
        if self._leaders is not None:
            self._leaders.allreduce(buf, op, name)
        self._local.broadcast(buf.view(np.uint8), 0)

    def broadcast(self, buf: np.ndarray, root: int, name: str | None = None) -> None:
        if not 0 <= root < self.size:
            raise ValueError(
                f"`root` must be in [0, size). Received: root={root} (size={self.size})"
            )
        view = buf.view(np.uint8)
        root_node, root_local = self._where[root]
        self._settle(
            "broadcast", {"bytes": view.nbytes, "root": root, "name": name},
            lambda: self._local.check("broadcast", nbytes=view.nbytes, root=root, name=name),
        )
        on_root_node = self._node == root_node
        if on_root_node and root_local != 0:
            self._local.broadcast(view, root_local, name)
        if self._leaders is not None:
            self._leaders.broadcast(view, root_node, name)
        if not on_root_node or root_local == 0:
            self._local.broadcast(view, 0, name)

    def allgatherv(
        self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int], name: str | None = None
    ) -> None:
        byte_counts = counts_in_bytes(counts, self.size, send.dtype.itemsize)
        recv_bytes = recv.view(np.uint8)
        self._settle(
            "allgather", {"counts": tuple(byte_counts), "name": name},
            lambda: self._local.check("allgather", counts_bytes=byte_counts, name=name),
        )
        node_counts = [byte_counts[g] for g in self._members[self._node]]
        node_blob = np.empty(sum(node_counts), np.uint8)
        self._local.allgatherv(send.view(np.uint8), node_blob, node_counts, name)
        if self._leaders is not None:
            # Each machine's block holds its ranks in local order; put every
            # rank's part at its place in group order.
            totals = [sum(byte_counts[g] for g in ms) for ms in self._members]
            blobs = np.empty(sum(totals), np.uint8)
            self._leaders.allgatherv(node_blob, blobs, totals, name)
            displ = np.concatenate([[0], np.cumsum(byte_counts)[:-1]]).astype(np.int64)
            at = 0
            for members in self._members:
                for g in members:
                    recv_bytes[displ[g] : displ[g] + byte_counts[g]] = blobs[
                        at : at + byte_counts[g]
                    ]
                    at += byte_counts[g]
        self._local.broadcast(recv_bytes, 0, name)

    def barrier(self) -> None:
        self._settle("barrier", {}, lambda: self._local.check("barrier"))
        self._local.barrier()
        if self._leaders is not None:
            self._leaders.barrier()
        self._local.barrier()

    def _settle(self, kind: str, fields: dict, check_machine: Callable[[], None]) -> None:
        """Returns once every rank of every machine called this collective alike.

        Otherwise raises ``CollectiveMismatchError`` with the same message on
        every rank of every machine, before any data moved. ``fields`` is what
        the machines must agree on; ``check_machine`` compares the call among
        this machine's ranks (the engine's header-only step).

        A rank whose machine agrees, and that is not its leader, returns at
        once: if another machine disagrees, its leader's verdict takes the
        place of the collective's first step on this machine, and that step
        raises.
        """
        local_mismatch = None
        try:
            check_machine()
        except errors.CollectiveMismatchError as exc:
            local_mismatch = str(exc)
        verdict = None
        if self._leaders is not None:
            verdict = self._agree_across_machines(kind, fields, local_mismatch)
        if verdict is not None or local_mismatch is not None:
            # Every rank here knows the call fails (the leader, from the
            # machines' verdicts; the others, from their machine's mismatch,
            # which their leader reported too): the leader's message reaches
            # them all.
            self._local.raise_mismatch(verdict or "")

    def _agree_across_machines(self, kind: str, fields: dict,
                               local_mismatch: str | None) -> str | None:
        """Leaders only: the mismatch message every rank raises, or None if all agree.

        The leaders compare what their machines were called with, and each
        machine's own verdict (a bounded wait). A mismatch inside a machine
        wins (the first machine's message), so the ranks of that machine and
        of every other raise the same one.
        """
        mine = {"collective": kind, **fields}
        everyone = self._leaders.agree(kind, {**mine, "mismatch": local_mismatch})
        if everyone is None:  # the same call everywhere, and the same verdict inside
            return local_mismatch
        inside = [other.pop("mismatch") for other in everyone]
        for message in inside:
            if message is not None:
                return message
        keys = list(dict.fromkeys(k for other in everyone for k in other))
        differing = [k for k in keys if any(o.get(k) != mine.get(k) for o in everyone)]
        shown = differing if "collective" in differing else [k for k in keys if k != "collective"]
        described = []
        for machine, other in enumerate(everyone):
            values = " ".join(
                str(other[k]) if k == "collective" else
                f"{k} {other[k]!r}" if k == "name" else f"{k} {other[k]}"
                for k in shown if k in other
            )
            verb = "called" if "collective" in differing else "has"
            described.append(f"rank {self._members[machine][0]} {verb} {values}".rstrip())
        title = "collective" if "collective" in differing else kind
        return f"{title} mismatch between machines: " + ", ".join(described)

    def wait_seconds(self) -> float | None:
        """Waits inside this machine only: time in MPI between machines counts as moving data."""
        return self._local.wait_seconds()

    def close(self) -> None:
        """Leaves the group (first, so that no peer waits on this rank), then
        releases both levels."""
        local = getattr(self, "_local", None)
        if local is not None:
            local.close()
        leaders, self._leaders = getattr(self, "_leaders", None), None
        if leaders is not None:
            leaders.close()
        comm, self._leaders_comm = getattr(self, "_leaders_comm", None), None
        if comm is not None:
            comm.Free()


def _layout_problem(machines: list[list[int]], everyone: list[tuple]) -> str | None:
    """What is inconsistent in a machines-by-local-rank layout, or None.

    Args:
        machines: group ranks of each machine's local ranks, as the leaders
            gathered them (the same list on every rank).
        everyone: ``(world rank, host, machine, local rank)`` of every group
            rank, in group rank order (the same list on every rank).
    """
    size = len(everyone)
    listed = sorted(g for members in machines for g in members)
    if listed != list(range(size)):
        return (f"the machines must list each of the {size} ranks once. Received: "
                f"machines {machines}")
    wrong = []
    for rank, (world, host, machine, local_rank) in enumerate(everyone):
        listing = machines[machine] if machine < len(machines) else []
        if local_rank >= len(listing) or listing[local_rank] != rank:
            wrong.append(f"rank {rank} (world rank {world}, host {host}) is local rank "
                         f"{local_rank} of machine {machine}, which lists {listing}")
    for machine, members in enumerate(machines):
        hosts = {everyone[g][1] for g in members}
        if len(hosts) > 1:
            wrong.append(f"machine {machine} spans hosts {sorted(hosts)} (ranks {members})")
    worlds = [world for world, _, _, _ in everyone]
    if len(set(worlds)) != size:
        wrong.append(f"world ranks {worlds} are not distinct")
    return "; ".join(wrong) or None
