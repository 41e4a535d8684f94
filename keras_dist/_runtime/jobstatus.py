"""The status files through which ranks tell ``kdrun`` how they ended.

``kdrun`` gives every rank ``KERAS_DIST_STATUS_DIR``, a private directory
(mode 0700) that it removes when the job ends. Each rank writes there:

- ``rank<r>.start``: JSON ``{"rank", "pid", "host"}``, when ``init()`` succeeds;
- ``rank<r>.error``: the traceback of an unhandled exception;
- ``rank<r>.done``: when the rank shuts down cleanly.

After a failed job, ``kdrun`` reads them back (``read_status``) to name the
rank that raised or died. Writing is best effort and never raises: a status
file that cannot be written must not hide the user's own error. Every writer
is a no-op when ``KERAS_DIST_STATUS_DIR`` is unset (no launcher, plain
``mpiexec``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket

STATUS_DIR_ENV = "KERAS_DIST_STATUS_DIR"

_FILE_RE = re.compile(r"^rank(\d+)\.(start|error|done)$")
_LABEL_RE = re.compile(r"^\[[^\]]*rank[^\]]*\]\s*")
_EXCEPTION_LINE_RE = re.compile(
    r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning|Fault)(:|$)"
)


def _write(rank: int, kind: str, text: str) -> None:
    directory = os.environ.get(STATUS_DIR_ENV)
    if not directory:
        return
    path = os.path.join(directory, f"rank{int(rank)}.{kind}")
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(partial, path)
    except OSError:
        try:
            os.unlink(partial)
        except OSError:
            pass


def record_start(rank: int) -> None:
    """Records that ``rank`` is running, with its pid and host name."""
    record = {"rank": int(rank), "pid": os.getpid(), "host": socket.gethostname()}
    _write(rank, "start", json.dumps(record))
    directory = os.environ.get(STATUS_DIR_ENV)
    if directory:  # init() again after shutdown(): the rank is running again
        try:
            os.unlink(os.path.join(directory, f"rank{int(rank)}.done"))
        except OSError:
            pass


def record_error(rank: int, text: str) -> None:
    """Records the (formatted) traceback of an unhandled exception on ``rank``."""
    _write(rank, "error", text)


def record_done(rank: int) -> None:
    """Records that ``rank`` shut down cleanly."""
    _write(rank, "done", "")


@dataclasses.dataclass(frozen=True)
class RankStatus:
    """What one rank reported through its status files."""

    rank: int
    pid: int | None = None
    host: str | None = None
    started: bool = False
    done: bool = False
    error: str | None = None

    @property
    def error_summary(self) -> str | None:
        """The last line of the traceback (``"ValueError: ..."``), or None."""
        if self.error is None:
            return None
        lines = [_LABEL_RE.sub("", line).strip() for line in self.error.splitlines()]
        lines = [line for line in lines if line]
        if not lines:
            return "(empty traceback)"
        # The last "SomeError: message" line: TensorFlow appends node and
        # op names after the exception line of the failing py_function.
        for line in reversed(lines):
            if _EXCEPTION_LINE_RE.match(line):
                return line
        return lines[-1]

    @property
    def is_peer_failure(self) -> bool:
        """The rank raised PeerFailureError: it saw another rank die or abort."""
        summary = self.error_summary
        return summary is not None and "PeerFailureError:" in summary

    def describe(self) -> str:
        """``"rank 1 (pid 1234 on host)"``, with what is known."""
        where = []
        if self.pid is not None:
            where.append(f"pid {self.pid}")
        if self.host:
            where.append(f"on {self.host}")
        return f"rank {self.rank} ({' '.join(where)})" if where else f"rank {self.rank}"


def read_status(directory: str) -> dict[int, RankStatus]:
    """Reads every rank's status files from ``directory``.

    Args:
        directory: the job's ``KERAS_DIST_STATUS_DIR``.

    Returns:
        ``{rank: RankStatus}`` for every rank that wrote at least one file
        (an unreadable or half-written file counts as absent).
    """
    found: dict[int, dict] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return {}
    for name in names:
        match = _FILE_RE.match(name)
        if not match:
            continue
        rank, kind = int(match.group(1)), match.group(2)
        try:
            with open(os.path.join(directory, name), encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        fields = found.setdefault(rank, {"rank": rank})
        if kind == "start":
            try:
                record = json.loads(text)
                fields["pid"] = int(record["pid"])
                fields["host"] = str(record["host"])
            except (ValueError, KeyError, TypeError):
                pass
            fields["started"] = True
        elif kind == "done":
            fields["done"] = True
        else:
            fields["error"] = text
    return {rank: RankStatus(**fields) for rank, fields in sorted(found.items())}
