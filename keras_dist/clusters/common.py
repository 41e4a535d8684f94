"""What every executor shares: the job's secret, its process manager on a port
bound once, the watch that names the rank that failed first, failure text."""

from __future__ import annotations

import secrets

from keras_dist._runtime import rendezvous

#: The variables an executor sets in each rank's process before ``kd.init()``.
SECRET_VARIABLE = "KERAS_DIST_SECRET"
SERVED_BY_LAUNCHER_VARIABLE = "KERAS_DIST_RENDEZVOUS_SERVED_BY_LAUNCHER"


def new_secret() -> str:
    """A job's secret: 32 random bytes, as hex text (what ``KERAS_DIST_SECRET`` holds)."""
    return secrets.token_hex(32)


def rank_environment(secret: str) -> dict[str, str]:
    """What a rank's process needs to join a job whose process manager its
    executor runs: the secret, and that rank 0 must not start another manager."""
    return {SECRET_VARIABLE: secret, SERVED_BY_LAUNCHER_VARIABLE: "1"}


class JobProcessManager:
    """A job's process manager, run by its executor as ``mpiexec`` runs Hydra:
    on a port bound once (never probed and bound again), with a watch,
    connected before any rank comes, on which the manager names the rank that
    failed first.

    Args:
        size: the number of ranks.
        timeout: seconds the ranks have to come.
        secret: the job's secret (``new_secret``).
        env: the manager's environment (default: this process's).

    Raises:
        OSError: the port cannot be bound or the manager not reached.
    """

    def __init__(self, size: int, timeout: float, secret: str,
                 env: dict[str, str] | None = None) -> None:
        listener = rendezvous.listen("", 0)
        self.manager = rendezvous.start_process_manager(listener, size, timeout,
                                                        secret.encode(), env)
        self.port = self.manager.port
        try:
            self.watch = rendezvous.watch("127.0.0.1", self.port, secret.encode(),
                                          timeout=timeout)
        except BaseException:
            self.manager.release()
            raise

    def first_failure(self) -> tuple[int | None, str] | None:
        """Blocks until the job ends: ``(rank, what happened)`` when a rank
        failed, None when the manager ended without a report (the job finished,
        or it never started)."""
        return rendezvous.wait_for_failure(self.watch)

    def close(self) -> None:
        """Stops watching and lets the manager go (it ends with the job, or at
        once when the job has not started)."""
        self.watch.close()
        self.manager.release()


def first_line(error: BaseException) -> str:
    """The first line of an error's text (its type's name when it has none)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
