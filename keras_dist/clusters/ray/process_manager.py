"""The code of the process that runs a RayExecutor job's process manager: a
Ray actor beside rank 0, as ``mpiexec`` runs Hydra beside the ranks."""

from __future__ import annotations

from keras_dist.clusters.common import JobProcessManager


class ProcessManagerActor:
    """Starts the job's process manager on a port it binds once, and names
    the rank that failed first. Not a rank: it outlives them. Runs with two
    threads (``max_concurrency=2``): ``first_failure`` blocks one."""

    def __init__(self) -> None:
        self.job: JobProcessManager | None = None

    def start(self, size: int, timeout: float, secret: str) -> int:
        """Starts the manager; returns its port."""
        self.job = JobProcessManager(size, timeout, secret)
        return self.job.port

    def server_pid(self) -> int:
        """The process manager's pid (for checks that nothing outlives the job)."""
        return self.job.manager.process.pid

    def first_failure(self) -> tuple[int | None, str] | None:
        """Blocks until the job ends: ``(rank, what happened)`` when a rank
        failed, None when the manager ended without a report (after a clean
        shutdown, or killed along with the ranks)."""
        return self.job.first_failure()
