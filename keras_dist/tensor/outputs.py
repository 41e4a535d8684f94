"""Recycled memory for large collective outputs.

glibc serves allocations over 32 MiB with a fresh mmap each time, and fresh
pages cost a fault and zeroing the first time they are written, about as long
as copying them (a large ``kd.allreduce`` result pays it before any data
moves; docs/performance.md gives the numbers). The pool
keeps the memory of a few such outputs and hands it out again once nothing
refers to it any more: every array made from a block, and every view of
those, holds a reference to the block, so a block whose only references are
the pool's own is unused. ``kd.shutdown()`` empties it.
"""

from __future__ import annotations

import math
import sys
import threading

import numpy as np

_MIB = 1 << 20


class OutputPool:
    """Arrays of at least ``min_bytes`` drawn from at most ``max_bytes`` of kept blocks.

    Blocks are kept by exact size; when a new block would pass ``max_bytes``,
    unused blocks are dropped, oldest first, and if the pool is still full the
    array is simply not pooled.
    """

    def __init__(self, min_bytes: int = 32 * _MIB, max_bytes: int = 256 * _MIB) -> None:
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes
        self._blocks: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.enabled = hasattr(sys, "getrefcount")

    def _unused(self, i: int) -> bool:
        # References to an unused block: the pool's list and getrefcount's argument.
        return sys.getrefcount(self._blocks[i]) <= 2

    def empty(self, shape: tuple[int, ...], dtype: np.dtype,
              min_bytes: int | None = None) -> np.ndarray:
        """An uninitialised C-contiguous array, from a recycled block when one is free.

        ``dtype`` must be a ``np.dtype`` (as ``array.dtype`` is); ``min_bytes``
        replaces the pool's smallest pooled size for this call.
        """
        nbytes = math.prod(shape) * dtype.itemsize
        smallest = self.min_bytes if min_bytes is None else min_bytes
        if nbytes < smallest or nbytes > self.max_bytes or not self.enabled:
            return np.empty(shape, dtype)
        with self._lock:
            blocks = self._blocks
            found = next((i for i in range(len(blocks))
                          if blocks[i].nbytes == nbytes and self._unused(i)), None)
            if found is None:
                total = sum(b.nbytes for b in blocks)
                i = 0
                while total + nbytes > self.max_bytes and i < len(blocks):
                    if self._unused(i):
                        total -= blocks.pop(i).nbytes
                    else:
                        i += 1
                if total + nbytes > self.max_bytes:
                    return np.empty(shape, dtype)
                blocks.append(np.empty(nbytes, np.uint8))
            else:  # most recently used last: dropped last
                blocks.append(blocks.pop(found))
            return blocks[-1].view(dtype).reshape(shape)

    def clear(self) -> None:
        """Forgets every block (arrays already handed out stay valid)."""
        with self._lock:
            self._blocks.clear()


#: The pool of large collective results.
POOL = OutputPool()
