"""The shared-memory transport: the native engine inside a machine, MPI between machines.

One POSIX shared-memory segment per machine holds a slot per local rank. Local
rank 0 creates it (mode 0600, a name scoped to the user and job with a random
part only the job's ranks learn), every local rank maps it, and it is unlinked
as soon as all have, so nothing is left in ``/dev/shm`` even after SIGKILL.

When the job spans machines (``cross_comm`` given), collectives are
hierarchical: the engine inside each machine, MPI among the local-rank-0
leaders over ``cross_comm``, and the engine again to hand the result back.

Ranks are numbered as in ``MPI.COMM_WORLD`` order of the group's members (the
rank of ``keras_dist``'s communicator when it is ``COMM_WORLD`` or a split of it
that keeps world order).
"""

from __future__ import annotations

import os
import re
import secrets
import warnings
from collections.abc import Sequence

import numpy as np

from keras_dist import _native, _vocab, errors
from keras_dist._config import Config
from keras_dist.transports.base import Transport

_NATIVE_ERRORS = (
    _native.CollectiveMismatchError,
    _native.PeerFailureError,
    _native.CollectiveTimeoutError,
    _native.TransportError,
)


# The peer a native PeerFailureError names after "<collective> on rank R: ": "rank P
# (pid ...) died ...", "rank P (local rank L) aborted: ...", "cannot read the buffer of
# rank P ...". A bare "local rank P" is not a rank of the job: no peer then.
_PEER_RE = re.compile(r": (?:cannot read the buffer of )?rank (\d+) ")


def _translate(exc: Exception) -> errors.KerasDistError:
    """The keras_dist error for a native engine error."""
    if isinstance(exc, _native.CollectiveMismatchError):
        return errors.CollectiveMismatchError(str(exc))
    if isinstance(exc, _native.PeerFailureError):
        found = _PEER_RE.search(str(exc))
        return errors.PeerFailureError(str(exc), peer_rank=int(found[1]) if found else None)
    if isinstance(exc, _native.CollectiveTimeoutError):
        return errors.CollectiveTimeoutError(str(exc))
    return errors.TransportError(str(exc))


def segment_name(job_id: str | None) -> str:
    """``/kd-<uid>-<job>-<random>``: scoped to the user and job, not guessable."""
    job = re.sub(r"[^A-Za-z0-9_.]", "", job_id or "")[:32] or "nojob"
    return f"/kd-{os.getuid()}-{job}-{secrets.token_hex(8)}"


def _warn_stall(message: str) -> None:
    warnings.warn(message, errors.StallWarning, stacklevel=2)


class ShmTransport(Transport):
    """Collectives through the native shared-memory engine.

    Args:
        local_comm: mpi4py communicator of the ranks on this machine.
        cross_comm: communicator of the ranks with this rank's local rank on
            every machine, or None (or size 1) when there is one machine.
        config: settings (``shm_slot_bytes``, ``stall_check_seconds``,
            ``timeout_seconds``, ``job_id``).

    Raises:
        TransportError: the segment cannot be created or opened on some rank.
    """

    name = "shm"

    def __init__(self, local_comm, cross_comm, config: Config) -> None:
        super().__init__()
        from mpi4py import MPI

        self._mpi = MPI
        self._local = local_comm
        self._engine = None
        local_rank, local_size = local_comm.Get_rank(), local_comm.Get_size()
        self._is_leader = local_rank == 0
        # Only the leaders talk across machines; their view decides for the machine.
        many_machines = cross_comm is not None and cross_comm.Get_size() > 1
        many_machines = local_comm.bcast(many_machines if self._is_leader else None, root=0)
        #: The leaders' communicator across machines (None on one machine or off-leader).
        self._cross = cross_comm if many_machines and self._is_leader else None
        self._hierarchical = many_machines

        # Topology: every rank's world rank, by machine and local rank.
        world_rank = MPI.COMM_WORLD.Get_rank()
        node_world = local_comm.allgather(world_rank)
        if self._hierarchical:
            machines = self._cross.allgather(node_world) if self._is_leader else None
            machines = local_comm.bcast(machines, root=0)
            self._node = self._cross.Get_rank() if self._is_leader else None
            self._node = local_comm.bcast(self._node, root=0)
        else:
            machines = [node_world]
            self._node = 0
        order = sorted(w for members in machines for w in members)
        group_rank = {w: i for i, w in enumerate(order)}
        #: Group ranks of each machine's local ranks, and (machine, local rank) of each rank.
        self._members = [[group_rank[w] for w in members] for members in machines]
        self._where = {g: (m, lr) for m, ms in enumerate(self._members) for lr, g in enumerate(ms)}
        self.rank = group_rank[world_rank]
        self.size = len(order)

        pids = local_comm.allgather(os.getpid())
        timeout = config.timeout_seconds or 0.0
        arguments = dict(
            local_rank=local_rank,
            local_size=local_size,
            slot_bytes=config.shm_slot_bytes,
            peer_pids=pids,
            stall_seconds=config.stall_check_seconds,
            timeout_seconds=timeout,
            global_ranks=self._members[self._node],
            on_stall=_warn_stall,
            single_copy=config.shm_single_copy == "auto",
            single_copy_bytes=max(1, config.shm_single_copy_bytes),
        )
        problem = None
        name = None
        if self._is_leader:
            name = segment_name(config.job_id)
            try:
                self._engine = _native.ShmEngine(name, True, **arguments)
            except (_native.TransportError, ValueError) as exc:
                problem = str(exc)
        name, problem = local_comm.bcast((name, problem), root=0)
        if problem is None and not self._is_leader:
            try:
                self._engine = _native.ShmEngine(name, False, **arguments)
            except (_native.TransportError, ValueError) as exc:
                problem = str(exc)
        problems = [p for p in local_comm.allgather(problem) if p]
        if problems:
            self._engine = None  # the creator's destructor unlinks the name
            raise errors.TransportError(f"shm transport unavailable: {problems[0]}")
        try:
            self._engine.attach()
        except _NATIVE_ERRORS as exc:
            raise _translate(exc) from None
        #: The leaders' transport across machines: MPI with bounded waits.
        self._cross_transport = None
        if self._cross is not None:
            from keras_dist.transports.mpi import MpiTransport

            same_host = self._cross.Split_type(MPI.COMM_TYPE_SHARED, key=self._cross.Get_rank())
            self._cross_transport = MpiTransport(self._cross, same_host, config)
        #: "on", or "off: <why>": whether large messages are read straight from
        #: peers' buffers (the same on every rank of a machine).
        self.single_copy_status = self._engine.single_copy_status
        #: dtype.num -> native dtype code, filled on first use of each dtype.
        self._codes: dict[int, int] = {}

    # -- collectives -------------------------------------------------------

    def allreduce(self, buf: np.ndarray, op: int, name: str | None = None,
                  send: np.ndarray | None = None) -> None:
        code = self._codes.get(buf.dtype.num)
        if code is None:
            code = self._codes[buf.dtype.num] = _vocab.dtype_code(buf.dtype)
        engine = self._engine
        if engine is None:
            raise errors.TransportError("shm transport is closed")
        if self._cross is not None:
            self._agree_across_machines(
                "allreduce",
                {"dtype": buf.dtype.name, "count": buf.size, "op": _vocab.OP_NAMES.get(op, op),
                 "name": name},
            )
        if self._hierarchical and _vocab.is_half(buf.dtype):
            # Both levels reduce in float32 and the result is rounded once, as
            # on one machine (the wider messages cost twice the bytes).
            wide = (buf if send is None else send).astype(np.float32)
            self._reduce(engine, wide, _vocab.FLOAT32, op, name, None)
            buf[...] = wide.astype(buf.dtype)
        else:
            self._reduce(engine, buf, code, op, name, send)

    def _reduce(self, engine, buf: np.ndarray, code: int, op: int, name: str | None,
                send: np.ndarray | None) -> None:
        """The engine's allreduce, then (hierarchical) the leaders' and a broadcast."""
        try:
            # The engine takes any buffer of the dtype's item size; numpy cannot
            # export bfloat16 buffers, so those travel as bytes.
            if code == _vocab.BFLOAT16:
                buf_view = buf.view(np.uint8)
                send = None if send is None else send.view(np.uint8)
            else:
                buf_view = buf
            engine.allreduce(buf_view, code, op, name, send)
            if self._hierarchical:
                if self._is_leader:
                    self._cross_transport.allreduce(buf, op, name)
                engine.broadcast(buf.view(np.uint8), 0)
        except _NATIVE_ERRORS as exc:
            raise _translate(exc) from None

    def broadcast(self, buf: np.ndarray, root: int, name: str | None = None) -> None:
        if not 0 <= root < self.size:
            raise ValueError(
                f"`root` must be in [0, size). Received: root={root} (size={self.size})"
            )
        view = buf.view(np.uint8)
        engine = self._engine
        if engine is None:
            raise errors.TransportError("shm transport is closed")
        root_node, root_local = self._where[root]
        if self._cross is not None:
            self._agree_across_machines(
                "broadcast", {"bytes": view.nbytes, "root": root, "name": name}
            )
        try:
            if not self._hierarchical:
                engine.broadcast(view, root_local, name)
                return
            on_root_node = self._node == root_node
            if on_root_node and root_local != 0:
                engine.broadcast(view, root_local, name)
            if self._is_leader:
                self._cross_transport.broadcast(view, root_node, name)
            if not on_root_node or root_local == 0:
                engine.broadcast(view, 0, name)
        except _NATIVE_ERRORS as exc:
            raise _translate(exc) from None

    def allgatherv(
        self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int], name: str | None = None
    ) -> None:
        if len(counts) != self.size:
            raise ValueError(
                f"`counts` must have one entry per rank. Received: {len(counts)} entries "
                f"(size={self.size})"
            )
        itemsize = send.dtype.itemsize
        byte_counts = [int(c) * itemsize for c in counts]
        engine = self._engine
        if engine is None:
            raise errors.TransportError("shm transport is closed")
        send_bytes, recv_bytes = send.view(np.uint8), recv.view(np.uint8)
        if self._cross is not None:
            self._agree_across_machines(
                "allgather", {"counts": tuple(byte_counts), "name": name}
            )
        try:
            if not self._hierarchical:
                engine.allgatherv(send_bytes, recv_bytes, byte_counts, name)
                return
            node_counts = [byte_counts[g] for g in self._members[self._node]]
            node_blob = np.empty(sum(node_counts), np.uint8)
            engine.allgatherv(send_bytes, node_blob, node_counts, name)
            if self._is_leader:
                totals = [sum(byte_counts[g] for g in ms) for ms in self._members]
                starts = np.concatenate([[0], np.cumsum(totals)[:-1]]).astype(np.int64).tolist()
                blobs = np.empty(sum(totals), np.uint8)
                self._cross_transport.allgatherv(node_blob, blobs, totals, name)
                displ = np.concatenate([[0], np.cumsum(byte_counts)[:-1]]).astype(np.int64)
                for machine, members in enumerate(self._members):
                    at = starts[machine]
                    for g in members:
                        recv_bytes[displ[g] : displ[g] + byte_counts[g]] = blobs[
                            at : at + byte_counts[g]
                        ]
                        at += byte_counts[g]
            engine.broadcast(recv_bytes, 0, name)
        except _NATIVE_ERRORS as exc:
            raise _translate(exc) from None

    def barrier(self) -> None:
        engine = self._engine
        if engine is None:
            raise errors.TransportError("shm transport is closed")
        if self._cross is not None:
            self._agree_across_machines("barrier", {})
        try:
            engine.barrier()
            if self._hierarchical:
                if self._is_leader:
                    self._cross_transport.barrier()
                engine.barrier()
        except _NATIVE_ERRORS as exc:
            raise _translate(exc) from None

    def _agree_across_machines(self, kind: str, fields: dict) -> None:
        """Leaders only: compares this collective with the other machines' first.

        Ranks inside a machine are compared by the engine; across machines the
        leaders exchange what they were called with before any MPI call, so a
        mismatch raises on every rank instead of hanging or mixing data.
        """
        mine = {"collective": kind, **fields}
        everyone = self._cross.allgather(mine)
        if all(other == mine for other in everyone):
            return
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
        message = f"{title} mismatch between machines: " + ", ".join(described)
        self._engine.abort_mismatch(message)
        raise errors.CollectiveMismatchError(message)

    def scratch(self, nbytes: int) -> np.ndarray:
        """A view of this rank's next shared buffer when it fits (one machine only).

        The view is valid until the next collective; ``allreduce`` of it (from
        its start) skips the copy into shared memory.
        """
        if self._engine is not None and not self._hierarchical:
            view = self._engine.scratch(nbytes)
            if view is not None:
                return view
        return super().scratch(nbytes)

    def close(self) -> None:
        cross, self._cross_transport = getattr(self, "_cross_transport", None), None
        if cross is not None:
            cross.close()
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.unlink()
