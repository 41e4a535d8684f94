"""What kdrun leaves behind: no process of the job, no shared-memory file."""

from __future__ import annotations

import os
import signal
import time

from keras_dist._runtime import procfs

JOB_ID_ENV = "KERAS_DIST_JOB_ID"
SHM_DIR = "/dev/shm"
# Shared-memory files of MPI runtimes (MPICH, UCX, Open MPI) that a killed job
# leaves in /dev/shm.
MPI_SHM_PREFIXES = (
    *procfs.MPICH_SEGMENT_PREFIXES,
    "ucx_shm_posix_",
    "vader_segment.",
    "sm_segment.",
)


def find_job_processes(name: str, value: str) -> list[int]:
    """Pids of live processes (other than this one) whose environment has ``name=value``."""
    return procfs.processes_with_env(name, value, exclude=os.getpid())


def kill_job_processes(job_id: str) -> int:
    """SIGKILLs every process carrying the job id; returns how many were found."""
    return kill_processes_with_env(JOB_ID_ENV, job_id)


def kill_processes_with_env(name: str, value: str) -> int:
    """SIGKILLs every process whose environment has ``name=value``, until none is left.

    Returns the most processes found at once.
    """
    total = 0
    for _ in range(200):  # 10 s: a SIGKILLed process with a large memory takes a while
        pids = find_job_processes(name, value)
        if not pids:
            break
        total = max(total, len(pids))
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)
    return total


def shm_snapshot() -> dict[str, int]:
    """``{name: inode}`` of the files now in /dev/shm."""
    try:
        return {entry.name: entry.inode() for entry in os.scandir(SHM_DIR)}
    except OSError:
        return {}


def _shm_in_use() -> set[str]:
    """Names of /dev/shm files that a live process maps or holds open."""
    used: set[str] = set()
    for pid in procfs.pids():
        used |= procfs.mapped_files(pid, SHM_DIR + "/")
    return used


def cleanup_shm(job_id: str, before: dict[str, int]) -> list[str]:
    """Removes the shared-memory files the job left in /dev/shm.

    That is: files of this user whose name holds the job id (keras_dist's own
    segments), and MPI runtimes' files (``MPI_SHM_PREFIXES``: MPICH's
    ``procfs.MPICH_SEGMENT_PREFIXES``, UCX's, Open MPI's) that appeared since the
    job started and that no live process maps or holds open. Returns the names removed.
    """
    uid = os.geteuid()
    candidates = []
    for name, inode in shm_snapshot().items():
        ours = job_id in name
        mpi_new = name.startswith(MPI_SHM_PREFIXES) and before.get(name) != inode
        if not (ours or mpi_new):
            continue
        try:
            if os.lstat(os.path.join(SHM_DIR, name)).st_uid != uid:
                continue
        except OSError:
            continue
        candidates.append((name, ours))
    if not candidates:
        return []
    in_use = _shm_in_use() if any(not ours for _, ours in candidates) else set()
    removed = []
    for name, ours in candidates:
        if not ours and name in in_use:
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except OSError:
            pass
    return removed
