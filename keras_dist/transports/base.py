"""The interface every transport implements.

A transport moves flat, C-contiguous, one-dimensional numpy buffers. It knows
nothing of tensors, Keras or fusion: the tensor layer (``ops.py``) hands it
buffers and an op code from ``keras_dist._vocab``.

Everything the tensor layer asks of a transport is declared here, with a
default for transports that lack the capability: reducing a bucket without a
fused buffer (``reduces_parts``, ``allreduce_parts``), going on after ranks
joined (``allreduce_mismatched``, ``raise_mismatched``, ``join``), and the
native engine the tensor layer may call directly (``native_engine``) with
its errors' translation (``translate_native_error``).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import NoReturn

import numpy as np


class Transport(abc.ABC):
    """A set of collectives over one group of processes."""

    #: Short name used in settings and error messages ("mpi", "shm", ...).
    name: str = ""
    #: Whether the transport copies device buffers through host memory (a GPU
    #: data plane staged on a CPU transport); the tensor layer counts those copies.
    stages_through_host: bool = False
    #: Whether ``allreduce_parts`` serves: the tensor layer then reduces an
    #: unscaled bucket with it rather than packing a fused buffer.
    reduces_parts: bool = False
    #: How this machine's engine moves large collectives (a sentence: whether
    #: ranks read their peers' memory directly, and if not why), or None for a
    #: transport without that choice. Benchmarks report it.
    single_copy_status: str | None = None

    def __init__(self) -> None:
        self._scratch = np.empty(0, np.uint8)

    @abc.abstractmethod
    def allreduce(self, buf: np.ndarray, op: int, name: str | None = None,
                  send: np.ndarray | None = None) -> None:
        """Reduces ``buf`` across ranks in place with ``op`` (SUM/MIN/MAX/PRODUCT).

        ``name``, where given, describes the call (the tensor layer passes the
        shapes and dtypes of a fused bucket); transports that check that all
        ranks agree include it in the check. ``send``, where given, is the
        input (1-D, like ``buf``, not overlapping it), and ``buf`` only
        receives the result: that saves the caller a copy.
        """

    def allreduce_parts(self, srcs: Sequence[np.ndarray], dsts: Sequence[np.ndarray], op: int,
                        average: bool = False, name: str | None = None) -> None:
        """Allreduce of ``srcs`` (arrays of one dtype) as one fused message into
        ``dsts`` (arrays shaped like ``srcs``), without a fused buffer.

        ``average`` turns a Sum into an Average (as ``_vocab.finishing_scale``).
        Only where ``reduces_parts`` is true.
        """
        raise NotImplementedError(f"the {self.name or type(self).__name__} transport does not "
                                  "reduce parts (reduces_parts is False)")

    def allreduce_mismatched(self, error: Exception, send: np.ndarray, op: int,
                             name: str | None) -> np.ndarray:
        """The result of an allreduce of ``send`` whose call raised ``error`` (a
        ``CollectiveMismatchError``), made on this transport or on its native
        engine directly.

        A transport that serves ``join`` runs the allreduce again with the
        joined ranks' contribution where ranks have joined; the default
        raises ``error``.
        """
        raise error

    def raise_mismatched(self, error: Exception, kind: str, send: np.ndarray,
                         name: str | None, root: int = -1) -> NoReturn:
        """Raises for a ``kind`` collective ("broadcast", "allgather") of ``send``
        whose call raised ``error`` (a ``CollectiveMismatchError``).

        A transport that serves ``join`` first takes part in what every rank
        does after a mismatch (and may raise why the call cannot go on); the
        default raises ``error``.
        """
        raise error

    def join(self) -> int:
        """Waits, serving the other ranks' allreduces, until every rank has
        joined; returns the rank (in the transport's numbering) that joined
        last. The join layer (``joinable``) serves it."""
        raise NotImplementedError(f"the {self.name or type(self).__name__} transport does not "
                                  "serve join")

    def translate_native_error(self, error: Exception) -> Exception:
        """The keras_dist error (``keras_dist.errors``) for ``error``, which this
        transport's native engine (``native_engine``) raised
        (a ``keras_dist._native.EngineError``)."""
        from keras_dist.errors import TransportError

        return TransportError(str(error))

    def native_engine(self):
        """The native engine (``keras_dist._native.ShmEngine``) that runs this
        transport's collectives among all of its ranks, or None.

        The tensor layer calls it directly where it can (the one-call
        collectives, the TensorFlow op, the XLA handler); its errors are the
        native ones (``translate_native_error``). None for a transport
        without one, and once the transport is closed.
        """
        return None

    @abc.abstractmethod
    def broadcast(self, buf: np.ndarray, root: int, name: str | None = None) -> None:
        """Overwrites ``buf`` on every rank with its contents on ``root``."""

    @abc.abstractmethod
    def allgatherv(
        self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int], name: str | None = None
    ) -> None:
        """Concatenates every rank's ``send`` into ``recv`` in rank order.

        ``counts[r]`` is the number of elements rank ``r`` sends; ``recv`` has
        ``sum(counts)`` elements of ``send``'s dtype.
        """

    def allgather_records(self, send: np.ndarray, recv: np.ndarray,
                          name: str | None = None) -> None:
        """Gathers every rank's record into ``recv`` in rank order.

        A record is a 1-D uint8 ``send`` of the same size on every rank whose
        first int64 word is the number of its bytes that matter (that word
        included); only those bytes of each place in ``recv`` are defined.
        This default gathers whole records; a transport that can copy only
        the used bytes does.
        """
        self.allgatherv(send, recv, [send.size] * (recv.size // send.size), name=name)

    @abc.abstractmethod
    def barrier(self) -> None:
        """Returns once every rank has entered the barrier."""

    def complete(self, what: str) -> None:
        """Returns once the work this transport has queued has finished.

        Transports whose collectives return when done (every CPU one) have
        nothing to wait for. A device transport (NCCL) queues its calls on a
        stream; the tensor layer calls this once per collective call (not per
        tensor), and it waits boundedly, raising as a waiting CPU transport
        does. ``what`` names the call in messages.
        """
        return None

    def scratch(self, nbytes: int) -> np.ndarray:
        """A reusable byte buffer of at least ``nbytes`` for packing messages.

        The tensor layer packs fused messages into it. A transport may return
        memory it can reduce from without a copy (the shm transport returns a
        view of its own shared slot); the default grows one private buffer.
        """
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(max(nbytes, 2 * self._scratch.nbytes), np.uint8)
        return self._scratch[:nbytes]

    def wait_seconds(self) -> float | None:
        """Seconds spent waiting for peers in collectives so far, or None when
        the transport cannot tell (the timeline then shows whole calls)."""
        return None

    def refuse_join(self, rank: int) -> str | None:
        """Called when ``rank`` (this rank) calls ``join``: None when the
        transport's collectives can go on with ranks joined, else why not,
        after telling the peers, whose collectives on this transport then
        raise with the same reason (so every rank raises). CPU transports
        serve ``join`` (``joinable``); the default says so."""
        return None

    def close(self) -> None:
        """Releases the transport's resources; safe to call twice."""
        return None


def counts_in_bytes(counts: Sequence[int], size: int, itemsize: int) -> list[int]:
    """``allgatherv``'s ``counts`` (elements per rank) in bytes; raises unless
    there is one per rank of a group of ``size``."""
    if len(counts) != size:
        raise ValueError(
            f"`counts` must have one entry per rank. Received: {len(counts)} entries "
            f"(size={size})"
        )
    return [int(c) * itemsize for c in counts]
