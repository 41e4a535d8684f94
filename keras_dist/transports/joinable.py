"""Uneven data: ``join``, as a layer over any transport.

A rank that has run out of data calls ``join()``. Until every rank has
joined, the others' allreduces go on with the joined ranks contributing the
op's identity (zeros for a sum, so an ``Average`` still divides by the full
size of the group, as in Horovod), and every other collective raises on the
ranks that called it. ``join`` returns the rank that joined last.

How, without a coordinator and at no cost while nobody has joined: a joined
rank repeatedly calls one collective, the *join exchange* (an allgather of a
fixed record). A rank that calls anything else then gets a
``CollectiveMismatchError`` from its transport, on every rank at once
(transports report a mismatch on every rank and stay usable). After any
mismatch, every rank that saw it takes part in one join exchange: each
publishes what it called (kind, dtype, count, op, root, a digest of the
call's description) or that it has joined. From the same records every rank
reaches the same verdict:

* nobody has joined: the mismatch is raised, as it would have been;
* some ranks joined and all others called the same allreduce: it runs again
  under a name every rank can form, the joined ranks adding the identity;
* some ranks joined and the others called something else (or disagree):
  the active ranks raise, saying which ranks have joined; the joined ranks
  keep waiting.

The last rank to call ``join`` meets only join exchanges, and every rank
returns.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NoReturn

import numpy as np

from keras_dist import _vocab
from keras_dist.errors import CollectiveMismatchError
from keras_dist.transports.base import Transport

_ACTIVE, _JOINED = 0, 1
_KINDS = {"allreduce": 1, "broadcast": 2, "allgather": 3, "barrier": 4}
#: status, kind, dtype code, count, op, root, digest of the description.
_RECORD = 7
_EXCHANGE = "keras_dist join exchange"


def _digest(name: str | None) -> int:
    return int.from_bytes(hashlib.blake2b((name or "").encode(), digest_size=7).digest(),
                          "little")


def _identity(op: int, dtype: np.dtype, count: int) -> np.ndarray:
    """What a joined rank adds to an allreduce: a value that leaves the result alone.

    Horovod adds zeros whatever the op; here a minimum or maximum is not
    changed by the joined ranks either.
    """
    if op == _vocab.SUM:
        return np.zeros(count, dtype)
    if op == _vocab.PRODUCT:
        return np.ones(count, dtype)
    if _vocab.is_float(dtype):
        return np.full(count, np.inf if op == _vocab.MIN else -np.inf, dtype)
    info = np.iinfo(dtype)
    return np.full(count, info.max if op == _vocab.MIN else info.min, dtype)


class JoinableTransport(Transport):
    """Wraps a transport so that ranks may ``join`` (see the module docstring).

    Every collective passes straight to the wrapped transport; only a
    ``CollectiveMismatchError`` costs one more collective (the exchange).
    ``reduces_parts``, ``single_copy_status``, the native engine and the
    waits are the wrapped transport's.

    Args:
        inner: the transport to wrap.
        rank: this rank in the group.
        size: the group's size.
    """

    def __init__(self, inner: Transport, rank: int, size: int) -> None:
        super().__init__()
        self.inner = inner
        self.name = inner.name
        self.rank, self.size = rank, size
        #: Ranks known to have joined at the last exchange (the same on every rank).
        self._joined: frozenset[int] = frozenset()
        self._dtypes: dict[int, np.dtype] = {}
        #: The last buffer ``scratch`` handed out (the wrapped transport's memory).
        self._scratch_view = np.empty(0, np.uint8)

    @property
    def reduces_parts(self) -> bool:
        return self.inner.reduces_parts

    @property
    def single_copy_status(self) -> str | None:
        return self.inner.single_copy_status

    def native_engine(self):
        """The wrapped transport's engine: its allreduces that raise a mismatch
        go on here (``allreduce_mismatched``, ``raise_mismatched``)."""
        return self.inner.native_engine()

    def translate_native_error(self, error: Exception) -> Exception:
        return self.inner.translate_native_error(error)

    def wait_seconds(self) -> float | None:
        return self.inner.wait_seconds()

    # -- collectives -------------------------------------------------------

    def allreduce(self, buf: np.ndarray, op: int, name: str | None = None,
                  send: np.ndarray | None = None) -> np.ndarray | None:
        """As ``Transport.allreduce``.

        Returns:
            None when the result is in ``buf``. After ranks joined, an array
            holding the result when ``buf`` is memory from ``scratch`` (the
            wrapped transport's, which the exchange has reused since).
        """
        try:
            self.inner.allreduce(buf, op, name, send)
            return None
        except CollectiveMismatchError as error:
            result = self.allreduce_mismatched(error, buf if send is None else send, op, name)
            if np.may_share_memory(buf, self._scratch_view):
                return result
            buf[...] = result
            return None

    def allreduce_mismatched(self, error: CollectiveMismatchError, send: np.ndarray, op: int,
                             name: str | None) -> np.ndarray:
        """The result of an allreduce of ``send`` whose wrapped call raised ``error``.

        For allreduces made on the wrapped transport directly (its one-call
        collectives) as well as through ``allreduce``: runs the exchange
        every rank makes after a mismatch, then the allreduce again with the
        joined ranks' contribution, or raises (``error``, or why not).
        """
        # Nothing has moved yet: keep the input before the exchange reuses buffers.
        saved = np.array(send, copy=True)
        record = self._record("allreduce", saved.dtype, saved.size, op, -1, name)
        records = self._exchange_after(error, record)
        self._refuse_unless_allreduce(error, records, "allreduce")
        result = np.empty_like(saved)
        self.inner.allreduce(result, op, self._joined_name(record), send=saved)
        return result

    def allreduce_parts(self, srcs: Sequence[np.ndarray], dsts: Sequence[np.ndarray], op: int,
                        average: bool = False, name: str | None = None) -> None:
        """The wrapped transport's ``allreduce_parts``; a mismatch it raises is
        the caller's to take to ``allreduce_mismatched`` (the sources are
        still whole)."""
        self.inner.allreduce_parts(srcs, dsts, op, average, name)

    def raise_mismatched(self, error: CollectiveMismatchError, kind: str, send: np.ndarray,
                         name: str | None, root: int = -1) -> NoReturn:
        """Raises for a ``kind`` collective ("broadcast", "allgather") of ``send`` whose
        call on the wrapped transport raised ``error``, after the exchange every rank
        makes (as ``broadcast`` and ``allgatherv`` do)."""
        records = self._exchange_after(error, self._record(kind, send.dtype, send.size, -1,
                                                           root, name))
        self._refuse_unless_allreduce(error, records, kind, always=True)
        raise error

    def broadcast(self, buf: np.ndarray, root: int, name: str | None = None) -> None:
        self._guard("broadcast", lambda: self.inner.broadcast(buf, root, name),
                    buf.dtype, buf.size, -1, root, name)

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int],
                   name: str | None = None) -> None:
        self._guard("allgather", lambda: self.inner.allgatherv(send, recv, counts, name),
                    send.dtype, send.size, -1, -1, name)

    def allgather_records(self, send: np.ndarray, recv: np.ndarray,
                          name: str | None = None) -> None:
        self._guard("allgather", lambda: self.inner.allgather_records(send, recv, name),
                    send.dtype, send.size, -1, -1, name)

    def barrier(self) -> None:
        self._guard("barrier", self.inner.barrier, np.dtype(np.uint8), 0, -1, -1, None)

    def scratch(self, nbytes: int) -> np.ndarray:
        self._scratch_view = self.inner.scratch(nbytes)
        return self._scratch_view

    def close(self) -> None:
        self.inner.close()

    # -- join ----------------------------------------------------------------

    def join(self) -> int:
        """Waits, serving the others' allreduces, until every rank has joined.

        Returns:
            The rank that joined last (the highest of them when several joined
            in the same exchange).
        """
        mine = np.zeros(_RECORD, np.int64)
        mine[0] = _JOINED
        while True:
            before = self._joined
            try:
                records = self._exchange(mine)
            except CollectiveMismatchError:
                continue  # the active ranks called something else, and raise
            active = records[records[:, 0] == _ACTIVE]
            if not len(active):
                self._joined = frozenset()
                return max(set(range(self.size)) - before)
            if (active[:, 1:] == active[0, 1:]).all() and active[0, 1] == _KINDS["allreduce"]:
                _, _, code, count, op, _, _ = (int(v) for v in active[0])
                dtype = self._dtype(code)
                contribution = _identity(op, dtype, count)
                self.inner.allreduce(np.empty_like(contribution), op,
                                     self._joined_name(active[0]), send=contribution)

    # -- helpers -------------------------------------------------------------

    def _guard(self, kind: str, call, dtype, count: int, op: int, root: int,
               name: str | None) -> None:
        try:
            call()
        except CollectiveMismatchError as error:
            records = self._exchange_after(error, self._record(kind, dtype, count, op, root,
                                                               name))
            self._refuse_unless_allreduce(error, records, kind, always=True)

    def _record(self, kind: str, dtype, count: int, op: int, root: int,
                name: str | None) -> np.ndarray:
        dtype = np.dtype(dtype)
        code = _vocab.dtype_code(dtype) if _vocab.is_supported(dtype) else -1
        if code >= 0:
            self._dtypes.setdefault(code, dtype)
        return np.array([_ACTIVE, _KINDS[kind], code, count, op, root, _digest(name)],
                        np.int64)

    def _exchange(self, record: np.ndarray) -> np.ndarray:
        records = np.empty(_RECORD * self.size, np.int64)
        self.inner.allgatherv(record, records, [_RECORD] * self.size, name=_EXCHANGE)
        records = records.reshape(self.size, _RECORD)
        self._joined = frozenset(np.flatnonzero(records[:, 0] == _JOINED).tolist())
        return records

    def _exchange_after(self, error: CollectiveMismatchError,
                        record: np.ndarray) -> np.ndarray:
        """The exchange every rank makes after a mismatch; the mismatch is
        raised if the exchange itself does not match (a rank bypassed this layer)."""
        try:
            return self._exchange(record)
        except CollectiveMismatchError:
            raise error from None

    def _refuse_unless_allreduce(self, error: CollectiveMismatchError, records: np.ndarray,
                                 kind: str, always: bool = False) -> None:
        joined = sorted(self._joined)
        if not joined:
            raise error
        active = records[records[:, 0] == _ACTIVE]
        agree = bool((active[:, 1:] == active[0, 1:]).all())
        if not agree:
            raise error
        if always or active[0, 1] != _KINDS["allreduce"]:
            raise CollectiveMismatchError(
                f"`{kind}` cannot run while ranks {joined} have called `join()`: until every "
                "rank has joined, only allreduce continues (the joined ranks contribute "
                "nothing to the sum)."
            ) from None

    @staticmethod
    def _joined_name(record: np.ndarray) -> str:
        return f"allreduce with joined ranks #{int(record[6]):x}"

    def _dtype(self, code: int) -> np.dtype:
        dtype = self._dtypes.get(code)
        if dtype is None:
            name = _vocab.DTYPE_NAMES[code]
            dtype = _vocab.bfloat16_dtype() if code == _vocab.BFLOAT16 else np.dtype(name)
            self._dtypes[code] = dtype
        return dtype
