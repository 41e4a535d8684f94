"""The MPI transport: mpi4py's buffer interface, no pickling of arrays.

Before its data moves, every collective checks that all ranks called the same
thing (kind, op, dtype, count, root, and the tensor layer's description) and
raises ``CollectiveMismatchError`` on every rank otherwise. That check is
where a rank waits for late peers: it is posted non-blocking and polled
through a ``Waiter``, so the wait is bounded: a dead peer on this machine
raises ``PeerFailureError``, as does a peer on this machine that has closed
its transport (left the group), a long wait warns (``StallWarning``) naming the
ranks that have not joined, and ``KERAS_DIST_TIMEOUT_SECONDS`` turns it into
``CollectiveTimeoutError``.

The check is an allgather of each rank's digest of its call plus
``CARRIED_BYTES`` of data: an allreduce that small (a scalar, a loss, a
metric) travels in the check and every rank reduces the gathered rows itself,
in rank order, so it costs one collective, not two. Across machines each
collective is a network round trip.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from keras_dist import _vocab
from keras_dist._runtime.liveness import Waiter, describe_peers
from keras_dist.errors import CollectiveMismatchError
from keras_dist.transports.base import Transport
from keras_dist.transports.ring import allreduce as ring_allreduce

#: Arrival-board value of a rank that has closed its transport (left the group).
_LEFT = -1
#: Bytes of data each rank's check carries: an allreduce this small travels in
#: its check and is reduced locally, one collective in place of two (across
#: machines each collective is a network round trip).
CARRIED_BYTES = 64
#: From this size, an allreduce among three or more machines goes round a
#: pipelined ring of point-to-point messages (``keras_dist.transports.ring``):
#: on 4 emulated hosts it carried 1.2-1.3x MPICH's own ``Allreduce`` at 16 and
#: 64 MiB, and less at 1 and 4 MiB.
RING_MIN_BYTES = 16 << 20


class MpiTransport(Transport):
    """Collectives over an mpi4py communicator.

    float16 and bfloat16 have no MPI datatype: they travel as float32, so the
    sum is accumulated in float32 and rounded once, as the native kernels do.

    Args:
        comm: the communicator of the whole group.
        local_comm: the ranks of ``comm`` on this machine (for liveness checks
            and the arrival board that names missing ranks).
        config: the process's ``Config``.
        rank_names: what messages call each rank of ``comm`` (its rank in a
            larger group, for a communicator among some of the group's
            ranks); defaults to its rank in ``comm``.
    """

    name = "mpi"

    def __init__(self, comm, local_comm, config, *,
                 rank_names: Sequence[int] | None = None) -> None:
        super().__init__()
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        names = list(range(comm.Get_size())) if rank_names is None else list(rank_names)
        if len(names) != comm.Get_size():
            raise ValueError(
                f"`rank_names` must name each of the {comm.Get_size()} ranks of `comm`. "
                f"Received: rank_names={names}"
            )
        self._names = names
        self._ops = {
            _vocab.SUM: MPI.SUM,
            _vocab.MIN: MPI.MIN,
            _vocab.MAX: MPI.MAX,
            _vocab.PRODUCT: MPI.PROD,
        }
        #: The same reductions over the rows of a carried allreduce.
        self._local_ops = {
            _vocab.SUM: np.add,
            _vocab.MIN: np.minimum,
            _vocab.MAX: np.maximum,
            _vocab.PRODUCT: np.multiply,
        }
        # Arrival board: one int64 per local rank in shared memory, holding the
        # number of collectives that rank has entered, or _LEFT once it closed.
        self._board_window = MPI.Win.Allocate_shared(8, 8, comm=local_comm)
        self._board = [
            np.frombuffer(self._board_window.Shared_query(r)[0], np.int64, 1)
            for r in range(local_comm.Get_size())
        ]
        self._board_ranks = local_comm.allgather(names[self.rank])
        self._local_rank = local_comm.Get_rank()
        self._board[self._local_rank][0] = 0
        self._spans_machines = local_comm.Get_size() < comm.Get_size()
        #: Whether large allreduces go round the ring: three or more machines.
        self._ring = sum(comm.allgather(self._local_rank == 0)) >= 3
        self._ring_scratch = np.empty(0, np.uint8)
        self._sequence = 0
        local_comm.Barrier()
        peers = [(names[rank], host, pid) for rank, host, pid in describe_peers(comm)]
        self._waiter = Waiter(
            peers, names[self.rank], config.stall_check_seconds,
            config.timeout_seconds, self.name, self._missing_ranks, self._departed_ranks,
        )

    def _missing_ranks(self) -> list[int] | None:
        missing = [rank for rank, board in zip(self._board_ranks, self._board)
                   if board[0] < self._sequence]
        return None if self._spans_machines and not missing else missing

    def _departed_ranks(self) -> list[int]:
        return [rank for rank, board in zip(self._board_ranks, self._board) if board[0] == _LEFT]

    def _enter(self, kind: str, signature: str, carried: np.ndarray | None = None):
        """Counts the collective on the board and checks every rank agrees on it.

        Returns every rank's ``carried`` bytes, one row per rank (see ``_check``).
        """
        signatures, rows = self._check(kind, signature, carried)
        if signatures is not None:
            detail = "; ".join(f"rank {self._names[r]}: {s}" for r, s in enumerate(signatures))
            raise CollectiveMismatchError(
                f"Ranks called different collectives at call #{self._sequence} "
                f"(transport mpi). {detail}"
            )
        return rows

    def agree(self, kind: str, description) -> list | None:
        """Checks that every rank called this with an equal ``description``.

        Counts as a collective of its own (on the arrival board and in the
        call numbers), and waits through the ``Waiter``, so the wait for late
        ranks is bounded. Comparison is by a digest of ``repr(description)``.

        Args:
            kind: the collective, for messages ("allreduce").
            description: a value whose ``repr`` every rank must share.

        Returns:
            None when all agree, else every rank's ``description`` in rank order.
        """
        return self._check(kind, description, None)[0]

    def _check(self, kind: str, description, carried: np.ndarray | None):
        """``agree``, whose one collective also carries up to ``CARRIED_BYTES`` of
        data from every rank (``carried``, any contiguous array, or None).

        Returns:
            ``(None or every rank's description, rows)``: ``rows[r]`` holds
            rank r's carried bytes (then zeros).
        """
        self._sequence += 1
        what = f"{kind} (check of call #{self._sequence})"
        self._waiter.check_departed(what)  # before posting a call nobody would answer
        self._board[self._local_rank][0] = self._sequence
        digest = int.from_bytes(
            hashlib.blake2b(repr(description).encode(), digest_size=7).digest(), "little")
        row = np.zeros(8 + CARRIED_BYTES, np.uint8)
        row[:8] = np.frombuffer(digest.to_bytes(8, "little"), np.uint8)
        if carried is not None:
            data = carried.reshape(-1).view(np.uint8)
            row[8:8 + data.size] = data
        rows = np.empty((self.comm.Get_size(), row.size), np.uint8)
        self._waiter.wait(self.comm.Iallgather(row, rows).Test, what)
        if (rows[:, :8] == row[:8]).all():
            return None, rows[:, 8:]
        # Every rank has entered this check (its result needed them all), so
        # every rank makes this call too.
        return self.comm.allgather(description), rows[:, 8:]

    # Once the check has passed, every rank has entered this very collective,
    # so the data moves through MPI's blocking call: MPI drives its own
    # progress (polling a non-blocking request from Python starves large
    # messages). A rank that dies during the transfer is the process
    # manager's to handle: MPICH ends the job, as it does for any MPI program.

    def allreduce(self, buf: np.ndarray, op: int, name: str | None = None,
                  send: np.ndarray | None = None) -> None:
        source = buf if send is None else send
        carry = buf.nbytes <= CARRIED_BYTES and not _vocab.is_half(buf.dtype)
        rows = self._enter("allreduce", f"allreduce op={_vocab.OP_NAMES[op]} "
                           f"dtype={buf.dtype.name} count={buf.size} {name or ''}",
                           np.ascontiguousarray(source) if carry else None)
        if carry:
            # Every rank reduces the same rows in the same order: equal results.
            values = rows[:, :buf.nbytes].copy().view(buf.dtype)
            reduced = self._local_ops[op].reduce(values, axis=0, dtype=buf.dtype)
            buf[...] = reduced.reshape(buf.shape)
            return
        if self._ring and buf.nbytes >= RING_MIN_BYTES and not _vocab.is_half(buf.dtype) \
                and buf.flags.c_contiguous:
            flat = buf.reshape(-1)
            if send is not None:
                np.copyto(flat, send.reshape(-1))
            ring_allreduce(self.comm, flat, self._local_ops[op], self._ring_buffer(flat))
            return
        mpi_op = self._ops[op]
        if _vocab.is_half(buf.dtype):
            wide = (buf if send is None else send).astype(np.float32)
            self.comm.Allreduce(self._mpi.IN_PLACE, wide, mpi_op)
            buf[...] = wide.astype(buf.dtype)
        else:
            self.comm.Allreduce(self._mpi.IN_PLACE if send is None else send, buf, mpi_op)

    def _ring_buffer(self, flat: np.ndarray) -> np.ndarray:
        """The ring's receive buffer for ``flat``'s largest chunk, kept between calls."""
        need = (flat.size // self.comm.Get_size() + 1) * flat.itemsize
        if self._ring_scratch.nbytes < need:
            self._ring_scratch = np.empty(need, np.uint8)
        return self._ring_scratch[:need].view(flat.dtype)

    def broadcast(self, buf: np.ndarray, root: int, name: str | None = None) -> None:
        self._enter("broadcast", f"broadcast root={root} bytes={buf.nbytes} {name or ''}")
        self.comm.Bcast(buf.view(np.uint8), root=root)

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int],
                   name: str | None = None) -> None:
        self._enter("allgather", f"allgather dtype={send.dtype.name} counts={list(counts)} "
                    f"{name or ''}")
        itemsize = send.dtype.itemsize
        byte_counts = [c * itemsize for c in counts]
        displacements = np.concatenate([[0], np.cumsum(byte_counts)[:-1]]).astype(int).tolist()
        self.comm.Allgatherv(
            send.view(np.uint8), [recv.view(np.uint8), byte_counts, displacements, self._mpi.BYTE]
        )

    def barrier(self) -> None:
        self._enter("barrier", "barrier")  # the check is itself a barrier

    def close(self) -> None:
        """Leaves the group (peers on this machine waiting for this rank raise), then
        frees the arrival board (collective among this machine's ranks)."""
        window, self._board_window = getattr(self, "_board_window", None), None
        if window is not None:
            self._board[self._local_rank][0] = _LEFT
            self._board = []
            window.Free()
