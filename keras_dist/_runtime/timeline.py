"""A Chrome-trace timeline of this process's collectives.

``start_timeline(path)`` opens a JSON trace (load it in chrome://tracing or
Perfetto); every collective adds one complete event with its kind, name and
bytes until ``stop_timeline()``. Only rank 0 writes, as in Horovod. Set
``KERAS_DIST_TIMELINE`` (or ``HOROVOD_TIMELINE``, or ``kdrun --timeline``)
to record a whole run.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

from keras_dist._runtime import context

_lock = threading.Lock()
_file = None
_first_event = True


def start_timeline(path: str) -> None:
    """Starts writing this rank's collectives to ``path`` (rank 0 only)."""
    global _file, _first_event
    group = context.get()
    if group.rank != 0:
        return
    with _lock:
        if _file is not None:
            raise ValueError(f"A timeline is already being written. Received: path={path!r}")
        _file = open(os.fspath(path), "w")  # noqa: SIM115 - closed by stop_timeline
        _file.write("[\n")
        _first_event = True


def stop_timeline() -> None:
    """Closes the timeline, leaving a valid JSON file. Safe to call twice."""
    global _file
    with _lock:
        if _file is None:
            return
        _file.write("\n]\n")
        _file.close()
        _file = None


_IDLE = contextlib.nullcontext()


def activity(name: str, kind: str, nbytes: int):
    """A context manager recording the time spent in its block as one event.

    Without a timeline it is a shared no-op, so collectives pay nothing.
    """
    return _IDLE if _file is None else _timed(name, kind, nbytes)


@contextlib.contextmanager
def _timed(name: str, kind: str, nbytes: int):
    start = time.perf_counter_ns()
    try:
        yield
    finally:
        _record(name, kind, nbytes, start, time.perf_counter_ns())


def _record(name: str, kind: str, nbytes: int, start_ns: int, end_ns: int) -> None:
    global _first_event
    event = {
        "name": name, "cat": kind, "ph": "X", "pid": 0, "tid": kind,
        "ts": start_ns / 1000.0, "dur": (end_ns - start_ns) / 1000.0,
        "args": {"bytes": nbytes},
    }
    with _lock:
        if _file is None:
            return
        _file.write(("" if _first_event else ",\n") + json.dumps(event))
        _first_event = False
