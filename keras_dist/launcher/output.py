"""kdrun's side of the supervisors' frames: labelled whole lines, per-rank files, records.

mpiexec hands kdrun every rank's supervisor output, frames
(``keras_dist.launcher.supervisor``) and whatever else was written (mpiexec's
own messages), which passes through unchanged. Output frames are put back
together into the segments the rank wrote (a line, or a ``\\r``-ended progress
bar redraw) and each is printed whole, prefixed with its rank: ``[1] text``.
Record frames go to a callback.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection
from typing import BinaryIO

from keras_dist.launcher.supervisor import MAGIC

_TERMINATORS = {"n": b"\n", "r": b"\r", ".": b""}


class OutputRouter:
    """Routes what mpiexec writes: to kdrun's stdout/stderr, to files, or to ``on_record``.

    Args:
        stdout: where the ranks' stdout lines (and mpiexec's stdout) go.
        stderr: where the ranks' stderr lines (and mpiexec's stderr) go.
        on_record: called with every record (a dict) a supervisor sent.
        label: prefix each rank's line with ``[rank] ``.
        ranks: print only these ranks' output (None: all).
        output_dir: write each rank's output, unlabelled, to
            ``DIR/rank<r>.stdout`` and ``DIR/rank<r>.stderr`` instead of printing it.
    """

    def __init__(self, stdout: BinaryIO, stderr: BinaryIO, on_record: Callable[[dict], None], *,
                 label: bool = True, ranks: Collection[int] | None = None,
                 output_dir: str | None = None, append: bool = False) -> None:
        self._sinks = {"o": stdout, "e": stderr}
        #: Add to the files in ``output_dir`` (later launches of an elastic job).
        self._mode = "ab" if append else "wb"
        self._on_record = on_record
        self._label = label
        self._ranks = None if ranks is None else frozenset(ranks)
        self._output_dir = output_dir
        self._buffers = {"o": b"", "e": b""}
        self._in_raw_line = {"o": False, "e": False}
        self._pieces: dict[tuple[int, str], list[bytes]] = {}
        self._after_cr: set[tuple[int, str]] = set()
        self._files: dict[tuple[int, str], BinaryIO] = {}
        self._dirty: set[str] = set()
        self._broken: set[str] = set()

    def feed(self, source: str, data: bytes) -> None:
        """Handles ``data`` read from mpiexec's stdout (``"o"``) or stderr (``"e"``)."""
        buffer = self._buffers[source] + data
        while buffer:
            if self._in_raw_line[source]:
                end = buffer.find(b"\n")
                text, buffer = (buffer, b"") if end < 0 else (buffer[: end + 1], buffer[end + 1:])
                self._write(source, text)
                self._in_raw_line[source] = end < 0
                continue
            if buffer.startswith(MAGIC):
                end = buffer.find(b"\n")
                if end < 0:
                    break  # the rest of the frame is still on its way
                self._frame(buffer[len(MAGIC): end])
                buffer = buffer[end + 1:]
            elif MAGIC.startswith(buffer):
                break  # may be the start of a frame
            else:
                self._in_raw_line[source] = True
        self._buffers[source] = buffer
        self.flush()

    def close(self) -> None:
        """Writes out what is left (partial lines, unfinished frames) and closes the files."""
        for source, buffer in self._buffers.items():
            if buffer:
                self._write(source, buffer)
            self._buffers[source] = b""
        for (rank, stream), pieces in sorted(self._pieces.items()):
            if pieces:
                self._segment(rank, stream, b"".join(pieces), ".")
        self._pieces.clear()
        self.flush()
        for handle in self._files.values():
            handle.close()
        self._files.clear()

    def flush(self) -> None:
        for source in self._dirty - self._broken:
            try:
                self._sinks[source].flush()
            except OSError:  # the reader went away (``kdrun ... | head``)
                self._broken.add(source)
        self._dirty.clear()

    def _write(self, source: str, data: bytes) -> None:
        if source in self._broken:
            return
        try:
            self._sinks[source].write(data)
        except OSError:
            self._broken.add(source)
        self._dirty.add(source)

    def _frame(self, body: bytes) -> None:
        rank_text, _, rest = body.partition(b" ")
        kind, _, payload = rest.partition(b" ")
        if not rank_text.isdigit():
            return
        rank = int(rank_text)
        if kind == b"R":
            try:
                record = json.loads(payload)
            except ValueError:
                return
            if isinstance(record, dict):
                self._on_record(record)
            return
        text = kind.decode(errors="replace")
        if len(text) != 2 or text[0] not in "oe" or text[1] not in "+nr.":
            return
        stream, end = text[0], text[1]
        pieces = self._pieces.setdefault((rank, stream), [])
        pieces.append(payload)
        if end != "+":
            del self._pieces[(rank, stream)]
            self._segment(rank, stream, b"".join(pieces), end)

    def _segment(self, rank: int, stream: str, text: bytes, end: str) -> None:
        """One whole segment of a rank's output: a line, or a \\r-ended redraw."""
        key = (rank, stream)
        terminator = _TERMINATORS[end]
        if self._output_dir is not None:
            self._file(rank, stream).write(text + terminator)
            return
        if self._ranks is not None and rank not in self._ranks:
            return
        after_cr = key in self._after_cr
        self._after_cr.discard(key)
        if end == "r":
            self._after_cr.add(key)
        if not self._label:
            self._write(stream, text + terminator)
        elif end == "n" and not text and after_cr:
            self._write(stream, b"\n")  # "\r\n": the line that the \r ended is over
        else:
            self._write(stream, b"[%d] %s%s" % (rank, text, terminator or b"\n"))

    def _file(self, rank: int, stream: str) -> BinaryIO:
        handle = self._files.get((rank, stream))
        if handle is None:
            name = f"rank{rank}.{'stdout' if stream == 'o' else 'stderr'}"
            handle = open(os.path.join(self._output_dir, name), self._mode, buffering=0)
            self._files[(rank, stream)] = handle
        return handle
