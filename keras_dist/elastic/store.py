"""Each machine's copy of an elastic job's committed state.

MPI cannot shrink or grow a running job, so kdrun relaunches every rank after
a failure or to resize; what the ranks had committed must outlive them. In
data-parallel training every rank holds the whole state, so one copy per
machine, written by the machine's local rank 0 at each commit, is enough: after
a relaunch the ranks take the newest commit that any machine still holds.
No shared file system is assumed; where machines do share one (or are network
namespaces of one machine), each keeps its own directory, named by host.

Layout: ``<base>/keras_dist-elastic-<job>/<host>/commit-<n>.npz``, written to
a temporary name and renamed, so a rank killed while writing leaves the
previous commit whole. Only the newest commit is kept.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
import socket

import numpy as np

from keras_dist._runtime.statedir import job_root

_COMMIT = re.compile(r"commit-(\d+)\.npz$")
#: Key of the pickled non-array part of a commit in its .npz file.
_META = "__meta__"


class Store:
    """This machine's commits of one elastic job."""

    def __init__(self, job_id: str, base: str | None = None, host: str | None = None) -> None:
        self.root = job_root(job_id, base)
        self.path = os.path.join(self.root, host or socket.gethostname())

    def newest(self) -> int:
        """The number of the newest whole commit held here (-1: none)."""
        try:
            names = os.listdir(self.path)
        except OSError:
            return -1
        numbers = [int(m[1]) for m in map(_COMMIT.match, names) if m]
        return max(numbers, default=-1)

    def write(self, number: int, arrays: list[np.ndarray], meta: dict) -> None:
        """Saves commit ``number`` and removes older ones."""
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        final = os.path.join(self.path, f"commit-{number}.npz")
        temporary = f"{final}.{os.getpid()}.tmp"
        payload = {f"a{i}": np.asarray(a) for i, a in enumerate(arrays)}
        payload[_META] = np.frombuffer(pickle.dumps(meta), dtype=np.uint8)
        with open(temporary, "wb") as file:
            np.savez(file, **payload)
        os.replace(temporary, final)
        for name in os.listdir(self.path):
            match = _COMMIT.match(name)
            if (match and int(match[1]) < number) or (
                    name.endswith(".tmp") and name != os.path.basename(temporary)
                    and not _held(name)):
                _remove(os.path.join(self.path, name))

    def read(self, number: int) -> tuple[list[np.ndarray], dict]:
        """Commit ``number``'s arrays (in the order written) and its other fields."""
        with open(os.path.join(self.path, f"commit-{number}.npz"), "rb") as file:
            data = io.BytesIO(file.read())
        with np.load(data, allow_pickle=False) as npz:
            count = len(npz.files) - 1
            arrays = [npz[f"a{i}"] for i in range(count)]
            meta = pickle.loads(npz[_META].tobytes())
        return arrays, meta

    def remove_job(self) -> None:
        """Removes every machine's copies of the job under this root."""
        shutil.rmtree(self.root, ignore_errors=True)


def _held(name: str) -> bool:
    """Whether the temporary file ``name`` belongs to a live writer."""
    pid = name.rsplit(".", 2)[-2]
    return pid.isdigit() and os.path.exists(f"/proc/{pid}")


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
