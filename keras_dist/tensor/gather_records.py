"""The record an allgather's first step gathers from every rank, and the
header inside it that describes a value (also what ``exchange`` gathers to
check the ranks' values agree).

native/src/one_call.h (the one-call allgather and the TensorFlow op) reads
and writes the same layout; ``tests/unit/test_shared_tables.py`` checks the
constants here against the ones the native module reports
(``_native.GATHER_RECORD``), and a record written here against one the
native module writes.
"""

from __future__ import annotations

import numpy as np

from keras_dist.errors import CollectiveMismatchError

#: An allgather's first step gathers a record from every rank, int64 words
#: ``[used bytes, inline, ndim, dtype.num, *shape padded to MAX_NDIM]``
#: followed, when the rank's data has at most ``INLINE_BYTES`` bytes
#: (``inline`` 1), by the data itself; the data step runs only when some
#: rank's data did not fit. Transports copy only each record's used bytes
#: where they can (``allgather_records``).
MAX_NDIM = 8
#: Words of a header: ``[ndim, dtype.num, *shape]``.
HEADER_WORDS = 2 + MAX_NDIM
RECORD_WORDS = 2 + HEADER_WORDS
INLINE_BYTES = 4096
RECORD_BYTES = 8 * RECORD_WORDS + INLINE_BYTES


def dtype_name(number: int) -> str:
    """The name of the numpy dtype whose type number is ``number``."""
    for code in np.typecodes["All"]:
        if np.dtype(code).num == number:
            return np.dtype(code).name
    return f"dtype #{number}"


def header_of(array: np.ndarray) -> np.ndarray:
    """``array``'s header: ``HEADER_WORDS`` int64s ``[ndim, dtype.num, *shape
    padded with zeros]`` (at most ``MAX_NDIM`` dimensions)."""
    header = np.zeros(HEADER_WORDS, np.int64)
    header[:2] = array.ndim, array.dtype.num
    header[2 : 2 + array.ndim] = array.shape
    return header


def describe(headers: np.ndarray, dtype: np.dtype | None = None) -> str:
    """Rank by rank, the shape and dtype each header (one row per rank) says
    (``dtype``: this rank's, named as numpy names it where the number is ambiguous)."""
    names = {int(h[1]): dtype_name(int(h[1])) for h in headers}
    if dtype is not None:
        names[dtype.num] = dtype.name
    return ", ".join(f"rank {r}: shape={shape} dtype={names[int(h[1])]}"
                     for r, (h, shape) in enumerate(zip(headers, shapes_of(headers))))


def mismatch_error(headers: np.ndarray, dtype: np.dtype) -> CollectiveMismatchError:
    """The error for ranks whose allgather headers (``[ndim, dtype.num, *shape]``
    per rank; this rank's dtype is ``dtype``) disagree."""
    detail = describe(headers, dtype)
    return CollectiveMismatchError(
        "`allgather` needs the same dtype and the same shape past the first "
        f"dimension on every rank. Received: {detail}"
    )


def record_of(array: np.ndarray) -> np.ndarray:
    """This rank's record for ``array`` (C-contiguous, 1 to ``MAX_NDIM`` dimensions)."""
    record = np.zeros(RECORD_BYTES, np.uint8)
    words = record[: 8 * RECORD_WORDS].view(np.int64)
    inline = array.nbytes <= INLINE_BYTES
    words[0] = 8 * RECORD_WORDS + (array.nbytes if inline else 0)
    words[1] = inline
    words[2:RECORD_WORDS] = header_of(array)
    if inline:
        record[8 * RECORD_WORDS : words[0]] = array.reshape(-1).view(np.uint8)
    return record


def is_inline(record: np.ndarray) -> bool:
    """Whether ``record`` carries its rank's data."""
    return bool(record[:16].view(np.int64)[1])


def data_of(record: np.ndarray) -> np.ndarray:
    """The bytes after ``record``'s words: its rank's data when ``is_inline``."""
    return record[8 * RECORD_WORDS :]


def headers_of(records: np.ndarray) -> np.ndarray:
    """Every rank's header ``[ndim, dtype.num, *shape padded]`` from the gathered
    ``records`` (one row per rank)."""
    return records.view(np.int64)[:, 2:RECORD_WORDS]


def shapes_of(headers: np.ndarray) -> list[tuple[int, ...]]:
    """The shape each header describes."""
    return [tuple(int(d) for d in h[2 : 2 + h[0]]) for h in headers]
