"""Functions that tests/cluster/test_ray.py runs on the ranks of a RayExecutor.

They import what they use inside, as a user's function does: the workers
import this module by name (the repository root is on their ``PYTHONPATH``).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
MNIST_EXAMPLE = REPO_ROOT / "examples" / "mnist" / "train.py"
MNIST_SUBSET = REPO_ROOT / "examples" / "mnist" / "mnist_5k.npz"

#: What each rank reduces: (seed offset, shape, dtype).
ALLREDUCE_CASES = ((0, (7,), "float32"), (1, (3, 5), "float64"), (2, (1000,), "float32"))


def rank_data(seed: int, rank: int) -> list[np.ndarray]:
    """Rank ``rank``'s inputs for ``allreduce_random``; the test recomputes them."""
    out = []
    for offset, shape, dtype in ALLREDUCE_CASES:
        rng = np.random.default_rng([seed, offset, rank])
        out.append(rng.standard_normal(shape).astype(dtype))
    return out


def allreduce_random(seed: int) -> dict:
    """Sum, average and max of every case across the job, with this rank's place."""
    import keras_dist as kd

    data = rank_data(seed, kd.rank())
    return {
        "rank": kd.rank(), "size": kd.size(), "local_rank": kd.local_rank(),
        "node_id": _node_id(),
        "sum": [kd.allreduce(x, op=kd.Sum) for x in data],
        "average": [kd.allreduce(x, op=kd.Average) for x in data],
        "max": [kd.allreduce(x, op=kd.Max) for x in data],
    }


def combine(a, b, *, scale=1) -> tuple[int, int]:
    """(rank, (a + b) * scale): arguments and keyword arguments arrive."""
    import keras_dist as kd

    return kd.rank(), (a + b) * scale


def describe() -> dict:
    """This rank's place, its process, the processes it started (rank 0's
    rendezvous server) and the /dev/shm files it maps (MPICH's segment)."""
    import keras_dist as kd
    from keras_dist._runtime import procfs

    pid = os.getpid()
    return {"rank": kd.rank(), "size": kd.size(), "pid": pid, "children": _children(pid),
            "shm": sorted(procfs.mapped_files(pid, "/dev/shm/")),
            "host": socket.gethostname(), "node_id": _node_id()}


def train_mnist_example(argv: list[str]):
    """The MNIST example's ``main(argv)``: (test accuracy, digest of the final weights)."""
    spec = importlib.util.spec_from_file_location("keras_dist_mnist_example", MNIST_EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def die_on_rank(victim: int) -> int:
    """Rank ``victim`` is killed; the others wait for it in an allreduce."""
    import keras_dist as kd

    if kd.rank() == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    kd.allreduce(np.ones(4), op=kd.Sum)
    return kd.rank()


class Boom(ValueError):
    """The error ``raise_on_rank`` raises."""


def raise_on_rank(victim: int) -> int:
    """Rank ``victim`` raises; the others wait for it in an allreduce."""
    import keras_dist as kd

    if kd.rank() == victim:
        raise Boom(f"boom on rank {kd.rank()}")
    kd.allreduce(np.ones(4), op=kd.Sum)
    return kd.rank()


class Counter:
    """An executable for ``RayExecutor.start(executable_cls=...)``."""

    def __init__(self, start: int, *, step: int = 1) -> None:
        self.value = start
        self.step = step

    def bump(self) -> tuple[int, int]:
        import keras_dist as kd

        self.value += self.step
        return kd.rank(), self.value


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(entry))
    return found
