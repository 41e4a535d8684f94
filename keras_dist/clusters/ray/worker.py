"""The code of a rank's process under RayExecutor: a Ray actor that joins the
job, then runs the driver's functions."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from keras_dist.clusters.ray.layout import Slot


class RankWorker:
    """One rank of the job.

    Its first methods run before any framework is imported in the process,
    so the environment set there reaches TensorFlow, JAX, torch and MPI.
    """

    def __init__(self, rank: int, env: Mapping[str, str]) -> None:
        os.environ.update(env)
        self.rank = rank
        self.executable = None

    def __repr__(self) -> str:  # Ray's prefix on this worker's output lines
        return f"keras_dist rank {self.rank}"

    def slot(self) -> Slot:
        return Slot(ip=ray.util.get_node_ip_address(), hostname=socket.gethostname(),
                    gpu_ids=tuple(str(gpu) for gpu in ray.get_gpu_ids()))

    def join(self, address: str, size: int, env: Mapping[str, str]) -> None:
        """Forms the job: ``env`` carries the secret, which ``kd.init()`` reads
        and removes from this process's environment."""
        os.environ.update(env)
        import keras_dist as kd

        kd.init(rendezvous=address, rank=self.rank, size=size)

    def start_executable(self, executable_cls, args: Sequence, kwargs: Mapping) -> None:
        self.executable = None if executable_cls is None else executable_cls(*args, **kwargs)

    def execute(self, fn: Callable[[Any], Any]) -> Any:
        return fn(self.executable)

    def call(self, fn: Callable[..., Any], args: Sequence, kwargs: Mapping) -> Any:
        return fn(*args, **kwargs)

    def abort(self) -> None:
        """Ends the job as an unhandled exception does under kdrun: the process
        manager tells every other rank that this one aborted."""
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)

    def finish(self) -> None:
        """Leaves the job: keras_dist, then MPI (collective: every rank at once)."""
        from mpi4py import MPI

        import keras_dist as kd

        kd.shutdown()
        if not MPI.Is_finalized():
            MPI.Finalize()
