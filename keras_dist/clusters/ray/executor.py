"""``RayExecutor``: keras_dist on a Ray cluster, as ``horovod.ray`` had it (the driver's code).

Each worker is a Ray actor (``worker.py``), placed by a placement group. At
``start()`` the executor starts the job's process manager beside rank 0
(``process_manager.py``, on a port bound once) with a secret made for this
job, and the actors form one keras_dist job with ``kd.init(rendezvous=...,
rank=, size=)``, so the job is what ``kdrun`` makes: the shared-memory engine
among the ranks of one machine, MPI or NCCL between machines. A job lives as
long as its workers (MPI starts once per process): ``shutdown()`` ends both,
and ``start()`` makes a new job.

A failure ends the job, as under ``kdrun``: when a worker dies, the process
manager tells every other rank (they end themselves) and tells this executor
which rank failed first; when the function raises on a rank, that rank aborts
the job. ``run()`` then raises ``PeerFailureError`` naming that rank.
``start()`` again makes a new job on new workers, which resumes from a
checkpoint (``keras.callbacks.BackupAndRestore`` works under keras_dist).
"""

from __future__ import annotations

import atexit
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from keras_dist._runtime.placement import whole_number
from keras_dist.clusters.common import first_line, new_secret, rank_environment
from keras_dist.clusters.ray.layout import Slot, bundle, rank_order, visible_gpus
from keras_dist.clusters.ray.process_manager import ProcessManagerActor
from keras_dist.clusters.ray.worker import RankWorker
from keras_dist.errors import KerasDistError, PeerFailureError

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
#: Seconds the other ranks get to end themselves once one has failed: each
#: ends within a second of the process manager's report (rendezvous.py); the
#: rest is room for a loaded machine. Those still running then are killed.
_SURVIVORS_END_SECONDS = 30.0
#: Seconds to wait for the process manager's report of the rank that failed first,
#: once Ray has reported a dead worker: it is sent the moment that rank's
#: connection closes.
_FIRST_FAILURE_WORD_SECONDS = 10.0
#: Seconds every rank gets to leave MPI at shutdown (MPI_Finalize is collective).
_FINISH_SECONDS = 60.0


@dataclasses.dataclass(frozen=True)
class RaySettings:
    """How long ``RayExecutor.start()`` waits (``RayExecutor.create_settings``).

    Attributes:
        timeout_s: seconds for the workers to start and form the job
            (``KERAS_DIST_RENDEZVOUS_TIMEOUT`` in each worker).
        placement_group_timeout_s: seconds for Ray to reserve the workers'
            resources (the placement group).
    """

    timeout_s: float = 300.0
    placement_group_timeout_s: float = 100.0


class RayExecutor:
    """Runs functions on every rank of a keras_dist job made of Ray actors.

    The names and arguments are those of ``horovod.ray.RayExecutor``, so a
    Horovod script changes its import lines only.

    Args:
        settings: a ``RaySettings`` (see ``create_settings``); None for the
            defaults.
        num_workers: the number of ranks, placed by a placement group of one
            bundle per worker with ``placement_strategy``.
        num_hosts: instead of ``num_workers``: this many machines (one bundle
            each, ``STRICT_SPREAD``) with ``num_workers_per_host`` ranks each.
        num_workers_per_host: ranks per machine, with ``num_hosts`` (default 1).
        cpus_per_worker: Ray CPUs reserved for each worker.
        use_gpu: reserve GPUs: ``gpus_per_worker`` each (default 1). Each
            worker sees the GPUs Ray gave to the workers of its machine, in
            local-rank order (``CUDA_VISIBLE_DEVICES``), so Horovod's recipe
            ``gpus[kd.local_rank()]`` picks its own.
        gpus_per_worker: GPUs per worker, with ``use_gpu``.
        placement_strategy: the placement group's strategy with
            ``num_workers``: ``"PACK"`` (default: fewest machines),
            ``"SPREAD"``, ``"STRICT_PACK"`` or ``"STRICT_SPREAD"``.

    Example:

    ```python
    from keras_dist.ray import RayExecutor

    def train():
        import keras_dist as kd
        ...  # the body of a kdrun script; kd.init() is already done
        return kd.rank()

    executor = RayExecutor(num_workers=4)
    executor.start()
    print(executor.run(train))  # [0, 1, 2, 3]
    executor.shutdown()
    ```
    """

    @classmethod
    def create_settings(cls, timeout_s: float = 300.0,
                        placement_group_timeout_s: float = 100.0) -> RaySettings:
        """Settings for the constructor, as Horovod's ``create_settings``.

        Args:
            timeout_s: seconds for the workers to start and form the job.
            placement_group_timeout_s: seconds for Ray to reserve their resources.
        """
        for name, value in (("timeout_s", timeout_s),
                            ("placement_group_timeout_s", placement_group_timeout_s)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"`{name}` must be a number of seconds > 0. "
                                 f"Received: {name}={value!r}")
        return RaySettings(float(timeout_s), float(placement_group_timeout_s))

    def __init__(self, settings: RaySettings | None = None, num_workers: int | None = None,
                 num_hosts: int | None = None, num_workers_per_host: int | None = None,
                 cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: float | None = None,
                 placement_strategy: str = "PACK") -> None:
        if settings is not None and not isinstance(settings, RaySettings):
            raise ValueError("`settings` must come from RayExecutor.create_settings(). "
                             f"Received: settings={settings!r}")
        if (num_workers is None) == (num_hosts is None):
            raise ValueError("Give `num_workers`, or `num_hosts` with `num_workers_per_host`. "
                             f"Received: num_workers={num_workers!r}, num_hosts={num_hosts!r}")
        if num_workers is not None:
            num_workers = whole_number(num_workers, "num_workers", minimum=1)
            if num_workers_per_host is not None:
                raise ValueError("`num_workers_per_host` goes with `num_hosts`. Received: "
                                 f"num_workers={num_workers}, "
                                 f"num_workers_per_host={num_workers_per_host!r}")
        else:
            num_workers_per_host = 1 if num_workers_per_host is None else num_workers_per_host
            num_hosts = whole_number(num_hosts, "num_hosts", minimum=1)
            num_workers_per_host = whole_number(num_workers_per_host, "num_workers_per_host",
                                                minimum=1)
        if placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"`placement_strategy` must be one of {PLACEMENT_STRATEGIES}. "
                             f"Received: placement_strategy={placement_strategy!r}")
        if num_hosts is not None and placement_strategy != "PACK":
            raise ValueError("`placement_strategy` goes with `num_workers` (`num_hosts` "
                             "places one bundle per machine, STRICT_SPREAD). Received: "
                             f"placement_strategy={placement_strategy!r}")
        if cpus_per_worker is None or cpus_per_worker < 0:
            raise ValueError(f"`cpus_per_worker` must be >= 0. "
                             f"Received: cpus_per_worker={cpus_per_worker!r}")
        if gpus_per_worker and not use_gpu:
            raise ValueError("`gpus_per_worker` needs `use_gpu=True`. "
                             f"Received: gpus_per_worker={gpus_per_worker!r}, use_gpu=False")
        if use_gpu and gpus_per_worker is not None and gpus_per_worker <= 0:
            raise ValueError(f"`gpus_per_worker` must be > 0 with `use_gpu=True`. "
                             f"Received: gpus_per_worker={gpus_per_worker!r}")
        self.settings = settings or RaySettings()
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.num_workers = num_workers if num_workers is not None else (
            num_hosts * num_workers_per_host)
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = bool(use_gpu)
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.placement_strategy = "STRICT_SPREAD" if num_hosts is not None else placement_strategy
        self._workers: list = []
        self._slots: list[Slot] = []
        self._placement_group = None
        self._process_manager = None
        self._first_failure = None  # the process manager's pending report
        self._ended: str | None = None

    # -- the job ----------------------------------------------------------
    @property
    def workers(self) -> list:
        """The workers' Ray actor handles, in rank order (empty when not running)."""
        return list(self._workers)

    def start(self, executable_cls: type | None = None, executable_args: Sequence | None = None,
              executable_kwargs: Mapping | None = None,
              extra_env_vars: Mapping[str, str] | None = None) -> None:
        """Starts the workers and forms the job; returns once every rank has joined.

        After ``shutdown()`` or a failure, ``start()`` starts a new job on new
        workers (MPI starts once per process, so a job never outlives its
        workers).

        Args:
            executable_cls: a class each worker instantiates once the job is
                formed; ``execute(fn)`` calls ``fn`` with that instance.
            executable_args: positional arguments for ``executable_cls``.
            executable_kwargs: keyword arguments for ``executable_cls``.
            extra_env_vars: environment variables set in each worker before
                anything is imported there (``KERAS_BACKEND``, thread counts...).

        Raises:
            KerasDistError: the resources could not be reserved within
                ``placement_group_timeout_s``, or a worker could not start or
                join the job (the message names it); nothing is left running.
        """
        if self._workers or self._placement_group is not None:
            raise KerasDistError("RayExecutor.start() was called on an executor that is "
                                 "running: it runs one job at a time; shut it down first.")
        self._ended = None
        if not ray.is_initialized():
            ray.init()
        # A driver that ends without shutdown(): Ray would kill every worker at
        # once, and MPICH's shared-memory segment would stay in /dev/shm.
        atexit.register(self._shutdown_at_exit)
        env = {str(name): str(value) for name, value in (extra_env_vars or {}).items()}
        env["KERAS_DIST_RENDEZVOUS_TIMEOUT"] = f"{self.settings.timeout_s:g}"
        try:
            self._place()
            actors = self._start_actors(env)
            self._join(actors)
            self._call_all(lambda worker: worker.start_executable.remote(
                executable_cls, tuple(executable_args or ()), dict(executable_kwargs or {})),
                "starting the executable")
        except BaseException:
            self._teardown()
            raise

    def _place(self) -> None:
        if self.num_hosts is not None:
            host_bundle = bundle(self.cpus_per_worker * self.num_workers_per_host,
                                 self.gpus_per_worker * self.num_workers_per_host)
            bundles = [host_bundle] * self.num_hosts
        else:
            bundles = [bundle(self.cpus_per_worker, self.gpus_per_worker)] * self.num_workers
        self._placement_group = placement_group(bundles, strategy=self.placement_strategy)
        ready, _ = ray.wait([self._placement_group.ready()],
                            timeout=self.settings.placement_group_timeout_s)
        if not ready:
            raise KerasDistError(
                f"Ray could not reserve {len(bundles)} bundle(s) of {bundles[0]} "
                f"({self.placement_strategy}) within {self.settings.placement_group_timeout_s:g} "
                f"s (placement_group_timeout_s). Available now: {ray.available_resources()}")

    def _start_actors(self, env: Mapping[str, str]) -> list:
        node_of_bundle = ray.util.placement_group_table(
            self._placement_group)["bundles_to_node_id"]
        bundles = rank_order(node_of_bundle, self.num_workers_per_host or 1)
        remote = ray.remote(RankWorker)
        self._workers = [remote.options(
            num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._placement_group, placement_group_bundle_index=index),
        ).remote(rank, env) for rank, index in enumerate(bundles)]
        # The job's process manager runs beside rank 0, where the ranks meet.
        self._process_manager = ray.remote(ProcessManagerActor).options(
            num_cpus=0, max_concurrency=2, scheduling_strategy=NodeAffinitySchedulingStrategy(
                node_of_bundle[bundles[0]], soft=False)).remote()
        self._slots = self._gather([worker.slot.remote() for worker in self._workers],
                                   "starting", timeout=self.settings.timeout_s)
        return self._workers

    def _join(self, workers: list) -> None:
        secret = new_secret()  # one per job, handed to its ranks only
        port = self._gather([self._process_manager.start.remote(
            len(workers), self.settings.timeout_s, secret)], "starting the process manager",
            timeout=self.settings.timeout_s)[0]
        self._first_failure = self._process_manager.first_failure.remote()
        address = f"{self._slots[0].ip}:{port}"
        envs = [rank_environment(secret) for _ in workers]
        if self.use_gpu:
            for rank, visible in enumerate(visible_gpus(self._slots)):
                envs[rank]["CUDA_VISIBLE_DEVICES"] = visible
        joins = [worker.join.remote(address, len(workers), envs[rank])
                 for rank, worker in enumerate(workers)]
        self._gather(joins, f"forming the job at {address}", timeout=self.settings.timeout_s)

    # -- running functions ----------------------------------------------------
    def run(self, fn: Callable[..., Any], args: Sequence | None = None,
            kwargs: Mapping | None = None) -> list:
        """Calls ``fn(*args, **kwargs)`` on every rank.

        Returns:
            Each rank's return value, in rank order.

        Raises:
            PeerFailureError: ``fn`` raised on a rank, or a worker died; its
                ``peer_rank`` is the rank that failed first, and the error
                raised there is the cause. The job has ended then (every
                worker is gone): ``start()`` makes a new one, which can
                resume from a checkpoint.
            KerasDistError: the executor is not running.
        """
        self._check_running()
        call_args, call_kwargs = tuple(args or ()), dict(kwargs or {})
        return self._call_all(lambda worker: worker.call.remote(fn, call_args, call_kwargs),
                              "run()")

    def run_remote(self, fn: Callable[..., Any], args: Sequence | None = None,
                   kwargs: Mapping | None = None) -> list:
        """Starts ``fn(*args, **kwargs)`` on every rank and returns at once.

        Returns:
            One Ray ``ObjectRef`` per rank, in rank order. ``ray.get`` raises
            Ray's own errors for them: unlike ``run()``, nothing here ends the
            job when a rank fails.
        """
        self._check_running()
        call_args, call_kwargs = tuple(args or ()), dict(kwargs or {})
        return [worker.call.remote(fn, call_args, call_kwargs) for worker in self._workers]

    def execute(self, fn: Callable[[Any], Any]) -> list:
        """Calls ``fn(executable)`` on every rank, with the instance of
        ``executable_cls`` made there by ``start()`` (None without one).

        Returns:
            Each rank's return value, in rank order.

        Raises:
            PeerFailureError: as ``run()``.
        """
        self._check_running()
        return self._call_all(lambda worker: worker.execute.remote(fn), "execute()")

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """Calls ``fn(executable)`` on rank 0 only (it must not wait for the others).

        Returns:
            Rank 0's return value.

        Raises:
            PeerFailureError: as ``run()``.
        """
        self._check_running()
        return self._collect([self._workers[0].execute.remote(fn)], [0], "execute_single()")[0]

    def shutdown(self) -> None:
        """Ends the job: every rank leaves keras_dist and MPI, the workers
        exit and their resources are released. Does nothing when not running."""
        if self._workers:
            finishing = [worker.finish.remote() for worker in self._workers]
            done, _ = ray.wait(finishing, num_returns=len(finishing), timeout=_FINISH_SECONDS)
            clean = len(done) == len(finishing)
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayError:
                    clean = False
            if clean:
                ending = [worker.__ray_terminate__.remote() for worker in self._workers]
                ray.wait(ending, num_returns=len(ending), timeout=_FINISH_SECONDS)
        self._teardown()
        if self._ended is None:
            self._ended = "shut down"

    def _shutdown_at_exit(self) -> None:
        if ray.is_initialized():
            self.shutdown()

    # -- failures ---------------------------------------------------------------
    def _check_running(self) -> None:
        if self._workers:
            return
        why = f" ({self._ended})" if self._ended else ""
        raise KerasDistError(f"This RayExecutor is not running{why}: call start() first "
                             "(after a failure, it starts a new job; resume from a checkpoint).")

    def _call_all(self, submit: Callable[[Any], Any], what: str) -> list:
        return self._collect([submit(worker) for worker in self._workers],
                             list(range(len(self._workers))), what)

    def _gather(self, refs: list, what: str, timeout: float | None = None) -> list:
        """Results of the start-up steps; a failure or a timeout names the worker."""
        pending = list(refs)
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=left,
                                      fetch_local=False)
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as error:
                    index = refs.index(ref)
                    raise KerasDistError(
                        f"RayExecutor: rank {index} of {len(refs)} failed while {what}: "
                        f"{first_line(error)}") from error
            if pending and deadline is not None and time.monotonic() >= deadline:
                missing = sorted(refs.index(ref) for ref in pending)
                raise KerasDistError(
                    f"RayExecutor: rank(s) {missing} of {len(refs)} did not finish {what} "
                    f"within {timeout:g} s (timeout_s).")
        return ray.get(refs)

    def _collect(self, refs: list, ranks: list[int], what: str) -> list:
        """Every rank's result; on the first failure, ends the job and raises."""
        results: list = [None] * len(refs)
        rank_of = {ref: rank for ref, rank in zip(refs, ranks)}
        pending = list(refs)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                for ref in ready:
                    try:
                        results[ranks.index(rank_of[ref])] = ray.get(ref)
                    except ray.exceptions.RayActorError as error:
                        raise self._end_after_death(rank_of[ref], error, what) from error
                    except ray.exceptions.RayError as error:
                        raise self._end_after_exception(rank_of[ref], error, what) from error
        except KeyboardInterrupt:
            # One rank killed ends the others (the process manager tells them).
            ray.kill(self._workers[-1], no_restart=True)
            self._end_job(f"{what} was interrupted")
            raise
        return results

    def _end_after_exception(self, rank: int, error: Exception, what: str) -> PeerFailureError:
        """``fn`` raised on ``rank`` (or its result could not come back): that
        rank aborts the job, as an unhandled exception does under kdrun, so no
        rank waits for it in a collective."""
        size = len(self._workers)
        if isinstance(error, ray.exceptions.RayTaskError):
            cause = error.cause
            happened = f"raised {type(cause).__name__} in {what}: {cause} (its traceback is above)"
        else:
            happened = f"failed in {what}: {first_line(error)}"
        self._workers[rank].abort.remote()
        self._end_job(f"rank {rank} failed in {what}")
        return PeerFailureError(
            f"rank {rank} of {size} {happened}. It aborted the job and the other ranks ended; "
            "start() a new job (and resume from a checkpoint).", peer_rank=rank)

    def _end_after_death(self, seen: int, error: Exception, what: str) -> PeerFailureError:
        """A worker died: the process manager says which rank failed first."""
        size = len(self._workers)
        answered, report = False, None
        if self._first_failure is not None:
            ready, _ = ray.wait([self._first_failure], timeout=_FIRST_FAILURE_WORD_SECONDS)
            try:
                report, answered = (ray.get(ready[0]), True) if ready else (None, False)
            except ray.exceptions.RayError:
                answered = False
        if answered and report is not None and report[0] is not None:
            rank, reason = report
            message = f"rank {rank} of {size} failed during {what}: {reason}"
        elif answered and report is None:
            rank = 0
            message = (f"rank 0 of {size} failed during {what}: the job's process manager, "
                       "which rank 0's worker runs, ended without a report (rank 0's process "
                       "or the process manager died)")
        else:
            rank = seen
            message = (f"rank {seen} of {size}'s worker died during {what} "
                       f"({first_line(error)}); the job's process manager did not say "
                       "which rank failed first")
        self._end_job(f"rank {rank} failed in {what}")
        return PeerFailureError(
            f"{message}. The other ranks ended with it; start() a new job (and resume from a "
            "checkpoint).", peer_rank=rank)

    def _end_job(self, reason: str) -> None:
        """The job is over: waits (bounded) for the ranks to end themselves,
        then kills what is left and releases the resources."""
        self._ended = reason
        terminations = [worker.__ray_terminate__.remote() for worker in self._workers]
        ray.wait(terminations, num_returns=len(terminations), timeout=_SURVIVORS_END_SECONDS)
        self._teardown()

    def _teardown(self) -> None:
        atexit.unregister(self._shutdown_at_exit)
        for actor in [*self._workers, self._process_manager]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        if self._placement_group is not None:
            remove_placement_group(self._placement_group)
        self._workers, self._slots = [], []
        self._process_manager = self._first_failure = self._placement_group = None
