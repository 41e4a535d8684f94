"""Everything keras_dist reads from ``/proc``, in one place (Linux only).

Each reader returns an empty or neutral value for a process that has gone or
cannot be read, never raises: callers poll processes that may exit at any time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

_PROC = "/proc"
# Name prefixes of the shared-memory segments MPICH creates in /dev/shm: its
# intranode segments (``mpich_shm_*``) and the temporary files it maps while
# setting them up (``mpich_shar_tmp*``).
MPICH_SEGMENT_PREFIXES = ("mpich_shm_", "mpich_shar_tmp")


def pids() -> Iterator[int]:
    """The pids of the processes that exist now (this one included)."""
    try:
        entries = os.listdir(_PROC)
    except OSError:
        return
    for entry in entries:
        if entry.isdigit():
            yield int(entry)


def _stat_fields(pid: int) -> list[bytes]:
    """``/proc/<pid>/stat`` after the command name: state, ppid, ... ([] if gone)."""
    try:
        with open(f"{_PROC}/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return []
    # The command name is parenthesised and may itself hold spaces or parentheses.
    return stat[stat.rfind(b")") + 2 :].split()


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (exited, not yet reaped) counts as dead."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] not in (b"Z", b"X")


def environ(pid: int) -> dict[bytes, bytes]:
    """The environment ``pid`` started with ({} when it cannot be read)."""
    try:
        with open(f"{_PROC}/{pid}/environ", "rb") as handle:
            items = handle.read().split(b"\0")
    except OSError:
        return {}
    return dict(item.partition(b"=")[::2] for item in items if item)


def processes_with_env(name: str, value: str, *, exclude: int | None = None) -> list[int]:
    """Pids of live processes whose environment has ``name=value``."""
    key, wanted = name.encode(), value.encode()
    return [pid for pid in pids() if pid != exclude and environ(pid).get(key) == wanted]


def mapped_files(pid: int, prefix: str) -> set[str]:
    """Paths under ``prefix`` that ``pid`` maps or holds open, with ``prefix`` removed.

    A process with no memory map left is exiting (the kernel drops a dying
    process's memory before its files): its open files do not count.
    """
    found: set[str] = set()
    try:
        with open(f"{_PROC}/{pid}/maps", encoding="utf-8", errors="replace") as handle:
            maps = handle.read()
    except OSError:
        return found
    if not maps:
        return found
    for line in maps.splitlines():
        at = line.find(prefix)
        if at >= 0:
            found.add(line[at + len(prefix):].strip().split(" ")[0])
    try:
        for fd in os.listdir(f"{_PROC}/{pid}/fd"):
            target = os.readlink(f"{_PROC}/{pid}/fd/{fd}")
            if target.startswith(prefix):
                found.add(target[len(prefix):].split(" ")[0])
    except OSError:
        pass
    return found

