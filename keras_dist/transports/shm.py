"""The shared-memory transport: the native engine among the ranks of one machine.

One POSIX shared-memory segment per machine holds a slot per local rank. Local
rank 0 creates it (mode 0600, a name scoped to the user and job with a random
part only the job's ranks learn), every local rank maps it, and it is unlinked
as soon as all have, so nothing is left in ``/dev/shm`` even after SIGKILL.

Ranks are numbered as in the communicator the transport is given. Jobs that
span machines use ``hierarchical.HierarchicalTransport``, which runs one of
these inside each machine.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import warnings
from collections.abc import Sequence

import numpy as np

from keras_dist import _native, _vocab, errors
from keras_dist._config import Config
from keras_dist.transports.base import Transport, counts_in_bytes
from keras_dist.transports.engine_errors import NATIVE_ERRORS, translate

__all__ = ["NATIVE_ERRORS", "ShmTransport", "segment_name", "translate"]

def segment_name(job_id: str | None) -> str:
    """``/kd-<uid>-<job>-<random>``: scoped to the user and job, not guessable."""
    job = re.sub(r"[^A-Za-z0-9_.]", "", job_id or "")[:32] or "nojob"
    return f"/kd-{os.getuid()}-{job}-{secrets.token_hex(8)}"


def _warn_stall(message: str) -> None:
    warnings.warn(message, errors.StallWarning, stacklevel=2)


class ShmTransport(Transport):
    """Collectives through the native shared-memory engine, on one machine.

    Args:
        comm: mpi4py communicator of ranks that all run on this machine; the
            transport's ranks are its ranks.
        config: settings (``shm_slot_bytes``, ``stall_check_seconds``,
            ``timeout_seconds``, ``shm_single_copy``, ``job_id``).
        group_ranks: what to call each rank of ``comm`` in messages (its rank
            in a larger group); defaults to its rank in ``comm``.

    Raises:
        TransportError: the ranks do not all run on one machine, disagree on
            ``group_ranks``, or the segment cannot be created or opened on
            some rank (raised on every rank).
    """

    name = "shm"
    reduces_parts = True

    def __init__(self, comm, config: Config, *, group_ranks: Sequence[int] | None = None) -> None:
        super().__init__()
        from mpi4py import MPI

        #: The native engine while the transport is open, else None
        #: (``native_engine``).
        self.engine = None
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        ranks = list(range(self.size)) if group_ranks is None else [int(r) for r in group_ranks]
        members = comm.allgather(
            (ranks, MPI.COMM_WORLD.Get_rank(), socket.gethostname(), os.getpid())
        )
        problem = _membership_problem(members, self.size)
        if problem:
            raise errors.TransportError(f"shm transport unavailable: {problem}")
        pids = [pid for _, _, _, pid in members]
        timeout = config.timeout_seconds or 0.0
        arguments = dict(
            local_rank=self.rank,
            local_size=self.size,
            slot_bytes=config.shm_slot_bytes,
            peer_pids=pids,
            stall_seconds=config.stall_check_seconds,
            timeout_seconds=timeout,
            global_ranks=ranks,
            on_stall=_warn_stall,
            single_copy=config.shm_single_copy == "auto",
            single_copy_bytes=max(1, config.shm_single_copy_bytes),
        )
        creator = self.rank == 0
        problem = None
        name = None
        if creator:
            name = segment_name(config.job_id)
            try:
                self.engine = _native.ShmEngine(name, True, **arguments)
            except (_native.TransportError, ValueError) as exc:
                problem = str(exc)
        name, problem = comm.bcast((name, problem), root=0)
        if problem is None and not creator:
            try:
                self.engine = _native.ShmEngine(name, False, **arguments)
            except (_native.TransportError, ValueError) as exc:
                problem = str(exc)
        problems = [p for p in comm.allgather(problem) if p]
        if problems:
            self.engine = None  # the creator's destructor unlinks the name
            raise errors.TransportError(f"shm transport unavailable: {problems[0]}")
        try:
            self.engine.attach()
        except NATIVE_ERRORS as exc:
            raise translate(exc) from None
        #: "on", or "off: <why>": whether large messages are read straight from
        #: peers' buffers (the same on every rank).
        self.single_copy_status = self.engine.single_copy_status
        #: dtype.num -> native dtype code, filled on first use of each dtype.
        self._codes: dict[int, int] = {}

    # -- collectives -------------------------------------------------------

    def allreduce(self, buf: np.ndarray, op: int, name: str | None = None,
                  send: np.ndarray | None = None) -> None:
        code = self._codes.get(buf.dtype.num)
        if code is None:
            code = self._codes[buf.dtype.num] = _vocab.dtype_code(buf.dtype)
        engine = self._open_engine()
        # The engine takes any buffer of the dtype's item size; numpy cannot
        # export bfloat16 buffers, so those travel as bytes.
        if code == _vocab.BFLOAT16:
            buf = buf.view(np.uint8)
            send = None if send is None else send.view(np.uint8)
        try:
            engine.allreduce(buf, code, op, name, send)
        except NATIVE_ERRORS as exc:
            raise translate(exc) from None

    def allreduce_parts(self, srcs: Sequence[np.ndarray], dsts: Sequence[np.ndarray], op: int,
                        average: bool = False, name: str | None = None) -> None:
        """As ``Transport.allreduce_parts``: the engine reads the sources in
        place and writes the results straight into ``dsts``, a message larger
        than one shared buffer in windows."""
        dtype = srcs[0].dtype
        code = self._codes.get(dtype.num)
        if code is None:
            code = self._codes[dtype.num] = _vocab.dtype_code(dtype)
        # C-contiguous numpy arrays of any shape, bfloat16 included, go as they
        # are, and numpy scalars (what tf.numpy_function hands over for a 0-d
        # tensor) as 0-d arrays; lists (subclasses too) without a copy.
        try:
            self._open_engine().allreduce_parts(
                srcs if isinstance(srcs, list) else list(srcs),
                dsts if isinstance(dsts, list) else list(dsts), code, op, average, name)
        except NATIVE_ERRORS as exc:
            raise translate(exc) from None

    def broadcast(self, buf: np.ndarray, root: int, name: str | None = None) -> None:
        if not 0 <= root < self.size:
            raise ValueError(
                f"`root` must be in [0, size). Received: root={root} (size={self.size})"
            )
        engine = self._open_engine()
        try:
            engine.broadcast(buf.view(np.uint8), root, name)
        except NATIVE_ERRORS as exc:
            raise translate(exc) from None

    def allgatherv(
        self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int], name: str | None = None
    ) -> None:
        byte_counts = counts_in_bytes(counts, self.size, send.dtype.itemsize)
        engine = self._open_engine()
        try:
            engine.allgatherv(send.view(np.uint8), recv.view(np.uint8), byte_counts, name)
        except NATIVE_ERRORS as exc:
            raise translate(exc) from None

    def allgather_records(self, send: np.ndarray, recv: np.ndarray,
                          name: str | None = None) -> None:
        engine = self._open_engine()
        try:
            engine.allgatherv(send, recv, [send.size] * self.size, name, prefixed=True)
        except NATIVE_ERRORS as exc:
            raise translate(exc) from None

    def barrier(self) -> None:
        engine = self._open_engine()
        try:
            engine.barrier()
        except NATIVE_ERRORS as exc:
            raise translate(exc) from None

    # -- header-only steps (for transports built on this one) ---------------

    def check(self, kind: str, *, nbytes: int = 0, dtype: np.dtype | None = None, op: int = 0,
              root: int = 0, counts_bytes: Sequence[int] = (), name: str | None = None) -> None:
        """Compares a collective among the ranks without moving data.

        Raises ``CollectiveMismatchError`` on every rank exactly when
        ``kind`` (``"allreduce"``, ``"broadcast"``, ``"allgather"`` or
        ``"barrier"``) with these arguments would; the transport stays usable.
        ``nbytes``/``dtype``/``op`` describe an allreduce, ``nbytes``/``root``
        a broadcast, ``counts_bytes`` an allgather.
        """
        engine = self._open_engine()
        try:
            if kind == "allreduce":
                engine.check_allreduce(nbytes, _vocab.dtype_code(dtype), op, name)
            elif kind == "broadcast":
                engine.check_broadcast(nbytes, root, name)
            elif kind == "allgather":
                engine.check_allgatherv([int(c) for c in counts_bytes], name)
            elif kind == "barrier":
                engine.check_barrier()
            else:
                raise ValueError(
                    "`kind` must be 'allreduce', 'broadcast', 'allgather' or 'barrier'. "
                    f"Received: kind={kind!r}"
                )
        except NATIVE_ERRORS as exc:
            raise translate(exc) from None

    def raise_mismatch(self, message: str) -> None:
        """Takes the place of this rank's next collective and fails it on every rank.

        Every rank raises ``CollectiveMismatchError`` for that collective,
        with the first non-empty ``message`` any rank gave (a verdict reached
        outside this transport); the transport stays usable.
        """
        try:
            self._open_engine().raise_mismatch(message)
        except NATIVE_ERRORS as exc:
            raise translate(exc) from None

    def scratch(self, nbytes: int) -> np.ndarray:
        """A view of this rank's next shared buffer when it fits.

        The view is valid until the next collective; ``allreduce`` of it (from
        its start) skips the copy into shared memory.
        """
        if self.engine is not None:
            view = self.engine.scratch(nbytes)
            if view is not None:
                return view
        return super().scratch(nbytes)

    def native_engine(self):
        return self.engine

    def translate_native_error(self, error: Exception) -> Exception:
        return translate(error)

    def wait_seconds(self) -> float | None:
        engine = self.engine
        return None if engine is None else engine.wait_seconds

    def _open_engine(self):
        engine = self.engine
        if engine is None:
            raise errors.TransportError("shm transport is closed")
        return engine

    def close(self) -> None:
        """Leaves the group (peers waiting for this rank raise) and releases the segment."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.leave()
            engine.unlink()


def _membership_problem(members: list, size: int) -> str | None:
    """What makes ``members`` unfit for one shm transport, or None.

    ``members[i]`` is ``(group ranks, world rank, host, pid)`` as rank ``i``
    sees them. Every rank computes this from the same list, so all reach the
    same verdict.
    """
    names = members[0][0]
    differ = [i for i, (ranks, _, _, _) in enumerate(members) if ranks != names]
    if differ:
        seen = ", ".join(f"rank {i} has {members[i][0]}" for i in [0, *differ])
        return f"the ranks disagree on `group_ranks`: {seen}"
    if len(names) != size or len(set(names)) != size:
        return (f"`group_ranks` must name each of the {size} ranks once. "
                f"Received: group_ranks={names}")
    hosts = {host for _, _, host, _ in members}
    if len(hosts) > 1:
        where = ", ".join(f"rank {names[i]} (world rank {world}) on {host}"
                          for i, (_, world, host, _) in enumerate(members))
        return f"its ranks must all run on one machine. Received: {where}"
    worlds = [world for _, world, _, _ in members]
    if len(set(worlds)) != size:
        return (f"each rank must be a distinct process of COMM_WORLD. Received world ranks "
                f"{worlds} for ranks {names}")
    return None
