"""A timeline's parts, one file per rank, and their merging into one trace.

Apart from ``timeline`` (the recording), so that kdrun merges a job's parts
without importing the runtime that records them (which starts MPI).
``python -m keras_dist._runtime.timeline PATH`` merges by hand.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
from collections.abc import Sequence


def part_path(path: str, rank: int) -> str:
    """Where rank ``rank`` writes its events for the timeline ``path``."""
    return f"{os.fspath(path)}.rank{rank}"


# ---------------------------------------------------------------------------
# Merging the parts.

_PART = re.compile(r"\.rank(\d+)$")


def merge(path: str) -> list[int]:
    """Joins the parts ``<path>.rank<R>`` into one Chrome trace at ``path``.

    Times start at the earliest event. A part cut short by a crash loses its
    unfinished last line only. The parts are removed.

    Returns:
        The ranks whose parts were found, in order (empty: nothing written).
    """
    path = os.fspath(path)
    parts = {}
    for name in glob.glob(glob.escape(path) + ".rank*"):
        found = _PART.search(name)
        if found and name == part_path(path, int(found.group(1))):
            parts[int(found.group(1))] = name
    if not parts:
        return []
    events = []
    for rank in sorted(parts):
        with open(parts[rank]) as part:
            for line in part:
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # the last line of a rank that died while writing
    origin = min((e["ts"] for e in events if "ts" in e), default=0)
    for event in events:
        if "ts" in event:
            event["ts"] = (event["ts"] - origin) / 1000.0
            event["dur"] = event["dur"] / 1000.0
    tmp = f"{path}.merging"
    with open(tmp, "w") as out:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, out)
    os.replace(tmp, path)
    for name in parts.values():
        os.unlink(name)
    return sorted(parts)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m keras_dist._runtime.timeline PATH``: merges a job's parts."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m keras_dist._runtime.timeline PATH", file=sys.stderr)
        return 2
    ranks = merge(args[0])
    if not ranks:
        print(f"no timeline parts found for {args[0]!r} ({args[0]}.rank<R>)", file=sys.stderr)
        return 1
    print(f"{args[0]}: ranks {ranks}")
    return 0

