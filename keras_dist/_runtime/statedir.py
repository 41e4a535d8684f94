"""Where each machine keeps an elastic job's committed state (used by the
ranks, which write it, and by kdrun, which removes it when the job ends)."""

from __future__ import annotations

import os
import tempfile


def job_root(job_id: str, base: str | None = None) -> str:
    """The directory holding every machine's copies for elastic job ``job_id``:
    under ``base``, else /dev/shm, else the temporary directory."""
    if base is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"keras_dist-elastic-{job_id}")
