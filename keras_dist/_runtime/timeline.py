"""A Chrome-trace (Perfetto) timeline of every rank's collectives and train steps.

``start_timeline(path)`` makes each rank stream its events, one JSON object a
line, to its own part file ``<path>.rank<R>`` (bounded memory however long the
job: events go to the file as they happen). ``merge(path)`` (kdrun runs it
when the job ends; ``python -m keras_dist._runtime.timeline PATH`` by hand)
puts every part into one JSON trace at ``path``, a process per rank, and
removes the parts. Set ``KERAS_DIST_TIMELINE`` (or ``HOROVOD_TIMELINE``, or
``kdrun --timeline``) to record a whole run.

Each collective is one span named by its kind, with the bytes and (inside the
gradient reduction) the tensors' names; on transports that measure waits
(shm, and shm inside each machine of a hierarchical job) it holds two child
spans: ``wait for peers`` (all the time the call waited for other ranks,
drawn first) and ``move data`` (the rest: copying and reducing). Train steps
come from ``keras_dist.callbacks.TimelineCallback``. ``stop_timeline()``
prints a summary line per rank (steps, waiting, moving data).

Off, a collective pays one attribute check (``activity`` returns a shared
no-op context).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Sequence

from keras_dist._runtime import context
from keras_dist._runtime.timeline_parts import main, merge, part_path  # noqa: F401  (public here)

_lock = threading.Lock()
_local = threading.local()


#: Each rank's tracks (threads, in the trace's terms), top to bottom.
_TRACKS = {"steps": 1, "collectives": 2}


class _Recorder:
    """This rank's open part file and running totals."""

    def __init__(self, path: str, rank: int, size: int) -> None:
        self.path = path
        self.rank = rank
        self.size = size
        self.file = open(part_path(path, rank), "w")  # noqa: SIM115 - closed by close()
        self.totals = {"steps": 0, "step_s": 0.0, "calls": 0, "wait_s": 0.0, "move_s": 0.0}
        self.write({"name": "process_name", "ph": "M", "pid": rank,
                    "args": {"name": f"rank {rank}"}})
        self.write({"name": "process_sort_index", "ph": "M", "pid": rank,
                    "args": {"sort_index": rank}})
        for track, tid in _TRACKS.items():
            self.write({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                        "args": {"name": track}})

    def write(self, event: dict) -> None:
        self.file.write(json.dumps(event, separators=(",", ":")) + "\n")

    def span(self, name: str, track: str, start_ns: int, dur_ns: int, args=None) -> None:
        # Parts hold whole nanoseconds (a float of microseconds since 1970
        # keeps only quarter microseconds); ``merge`` turns them into the
        # trace format's microseconds from the job's first event.
        event = {"name": name, "ph": "X", "pid": self.rank, "tid": _TRACKS[track],
                 "ts": int(start_ns), "dur": max(int(dur_ns), 0)}
        if args:
            event["args"] = args
        self.write(event)

    def summary(self) -> str:
        t = self.totals
        return (f"keras_dist timeline rank {self.rank}: {t['steps']} steps, "
                f"{t['step_s']:.3f} s in steps; {t['calls']} collectives: "
                f"{t['wait_s']:.3f} s waiting for peers, {t['move_s']:.3f} s moving data")

    def close(self) -> None:
        self.file.close()


_recorder: _Recorder | None = None


def enabled() -> bool:
    """Whether this rank is recording."""
    return _recorder is not None


def now_ns() -> int:
    """The timeline's clock: wall-clock nanoseconds, comparable between the
    processes of one machine (and between machines as far as their clocks
    agree), unlike ``perf_counter``."""
    return time.time_ns()


def start_timeline(path: str, mark_cycles: bool = False) -> None:
    """Starts recording this rank's collectives to ``<path>.rank<R>``.

    Call it on every rank (as kdrun's ``--timeline`` does); ``merge(path)``
    joins the parts. ``mark_cycles`` is accepted for Horovod's signature and
    has no effect.

    Raises:
        ValueError: a timeline is already being recorded.
    """
    del mark_cycles
    global _recorder
    group = context.get()
    with _lock:
        if _recorder is not None:
            raise ValueError("A timeline is already being recorded "
                             f"(to {_recorder.path!r}). Received: path={path!r}")
        _recorder = _Recorder(os.fspath(path), group.rank, group.size)
        from keras_dist import _native

        _native.set_dispatch_recording(True)


def stop_timeline(summary: bool = True) -> None:
    """Closes this rank's part and prints its summary line to stderr. Safe to call twice.

    In a job of one rank the part becomes the trace at once (``merge``); with
    more, kdrun merges the parts when the job ends.
    """
    global _recorder
    with _lock:
        recorder, _recorder = _recorder, None
        if recorder is None:
            return
        from keras_dist import _native

        _native.set_dispatch_recording(False)
        recorder.close()
    if summary:
        print(recorder.summary(), file=sys.stderr, flush=True)
    if recorder.size == 1:
        merge(recorder.path)


_IDLE = contextlib.nullcontext()


def activity(name: str, kind: str, nbytes: int, transport=None,
             names: Sequence[str] | None = None):
    """A context manager recording its block as one collective.

    Args:
        name: the collective's label.
        kind: "allreduce", "broadcast", ...
        nbytes: bytes the rank contributes.
        transport: the transport doing the work; when it measures its waits
            (``Transport.wait_seconds``) the span is split into waiting and
            moving data.
        names: the tensors' names (default: those of ``tensor_names``).

    Without a timeline it is a shared no-op, so collectives pay nothing.
    """
    return _IDLE if _recorder is None else _timed(name, kind, nbytes, transport, names)


@contextlib.contextmanager
def tensor_names(names: Sequence[str]):
    """Labels the collectives that start inside the block with ``names``.

    The gradient reduction sets this around its grouped allreduces; inside a
    traced step the labels are read when the step is traced and travel with
    the collective (see ``current_names``).
    """
    previous = getattr(_local, "names", None)
    _local.names = list(names)
    try:
        yield
    finally:
        _local.names = previous


def current_names() -> list[str] | None:
    """The names set by the innermost ``tensor_names`` block, or None."""
    return getattr(_local, "names", None)


@contextlib.contextmanager
def _timed(name: str, kind: str, nbytes: int, transport, names: Sequence[str] | None):
    waited = transport.wait_seconds() if transport is not None else None
    start = now_ns()
    try:
        yield
    finally:
        end = now_ns()
        after = transport.wait_seconds() if waited is not None else None
        record_collective(name, kind, nbytes, start, end,
                          None if after is None else int((after - waited) * 1e9),
                          names if names is not None else current_names())


def record_collective(name: str, kind: str, nbytes: int, start: int, end: int,
                      wait_ns: int | None, names: Sequence[str] | None) -> None:
    """Records one collective from ``start`` to ``end`` (``now_ns`` clock), of which
    ``wait_ns`` waiting for peers (None: not measured), if a timeline records."""
    # The hot path while recording: the collective's constant part is
    # encoded once (``_encoded``), each event is one formatted line.
    head = _encoded(name, kind, int(nbytes), tuple(names) if names else ())
    with _lock:
        recorder = _recorder
        if recorder is None:
            return
        pid, tid, totals = recorder.rank, _TRACKS["collectives"], recorder.totals
        lines = f'{{"name":"{kind}","ph":"X","pid":{pid},"tid":{tid},"ts":{start},' \
                f'"dur":{end - start},{head}}}\n'
        totals["calls"] += 1
        if wait_ns is None:
            totals["move_s"] += (end - start) / 1e9
        else:
            wait_ns = min(max(wait_ns, 0), end - start)
            lines += (f'{{"name":"wait for peers","ph":"X","pid":{pid},"tid":{tid},'
                      f'"ts":{start},"dur":{wait_ns}}}\n'
                      f'{{"name":"move data","ph":"X","pid":{pid},"tid":{tid},'
                      f'"ts":{start + wait_ns},"dur":{end - start - wait_ns}}}\n')
            totals["wait_s"] += wait_ns / 1e9
            totals["move_s"] += (end - start - wait_ns) / 1e9
        recorder.file.write(lines)


@functools.lru_cache(maxsize=4096)
def _encoded(name: str, kind: str, nbytes: int, names: tuple) -> str:
    args = {"bytes": nbytes, "name": name}
    if names:
        args["tensors"] = list(names)
    return '"args":' + json.dumps(args, separators=(",", ":"))


def totals() -> dict:
    """This rank's running totals (steps, step_s, calls, wait_s, move_s); zeros when off."""
    with _lock:
        if _recorder is None:
            return {"steps": 0, "step_s": 0.0, "calls": 0, "wait_s": 0.0, "move_s": 0.0}
        return dict(_recorder.totals)


def record_step(label: str, start_ns: int, end_ns: int) -> None:
    """Records one train step (``TimelineCallback`` calls it), times from ``now_ns``."""
    with _lock:
        recorder = _recorder
        if recorder is None:
            return
        recorder.span(label, "steps", start_ns, end_ns - start_ns)
        recorder.totals["steps"] += 1
        recorder.totals["step_s"] += (end_ns - start_ns) / 1e9


if __name__ == "__main__":
    sys.exit(main())
