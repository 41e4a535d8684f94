"""What a Spark task tells the driver, and how.

A task connects to the driver's relay and proves the run's secret
(``keras_dist._runtime.wire``: the claim ``cmd=kd_relay rank=R``), then sends
JSON records, one a line: ``{"started": {...}}`` once its process runs,
``{"stream": "stdout"|"stderr", "line": ...}`` for each line the process
writes, and ``{"outcome": {...}}`` (an ``Outcome``) at the end. The driver
reads nothing else, and nothing from a connection that has not proved the
secret; a record longer than ``RECORD_BYTES`` closes the connection.
"""

from __future__ import annotations

import base64
import dataclasses
import json

#: The longest record the driver reads from a task.
RECORD_BYTES = 8 << 20
#: A line of a process's output longer than this is cut (the rest marked).
LINE_CHARS = 64 << 10
#: An exception that pickles to more than this travels as its text only.
EXCEPTION_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How one rank's process ended.

    Attributes:
        where: ``"pid P on HOST"``.
        result: what ``fn`` returned, pickled, when it returned.
        summary: how the process failed, in one line (None when it did not):
            ``"fn raised ValueError: ..."``, ``"killed by SIGKILL"``, ...
        details: ``fn``'s traceback, or the last lines of the process's stderr.
        raised: ``fn`` raised an exception (rather than the process dying).
        exception: the exception ``fn`` raised, cloudpickled, when it can be.
        first_failure: rank 0's task only: the process manager's report of the
            rank that failed first, ``{"rank": R, "message": ...}``.
    """

    where: str
    result: bytes | None = None
    summary: str | None = None
    details: str = ""
    raised: bool = False
    exception: bytes | None = None
    first_failure: dict | None = None

    def describe(self, rank: int, size: int) -> str:
        return describe(rank, size, self.where, self.summary, self.details)

    def record(self) -> dict:
        """What the driver is told (JSON; the result travels with Spark)."""
        exception = self.exception
        if exception is not None and len(exception) > EXCEPTION_BYTES:
            exception = None
        return {"where": self.where, "summary": self.summary, "details": self.details,
                "raised": self.raised, "first_failure": self.first_failure,
                "exception": None if exception is None else base64.b64encode(exception).decode()}


def describe(rank: int, size: int, where: str, summary: str | None, details: str) -> str:
    return f"rank {rank} of {size} ({where}): {summary}" + (f"\n{details}" if details else "")


def encode(record: dict) -> bytes:
    return json.dumps(record).encode() + b"\n"


def output_line(stream: str, text: str) -> dict:
    if len(text) > LINE_CHARS:
        text = text[:LINE_CHARS] + f" [... {len(text) - LINE_CHARS} more characters]"
    return {"stream": stream, "line": text}


def decode(line: bytes) -> dict | None:
    """A record, or None for anything else (never raises)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None
