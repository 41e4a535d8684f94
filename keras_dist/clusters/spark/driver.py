"""``keras_dist.spark.run``: run a function as one keras_dist job on a Spark
cluster, in barrier execution mode (the driver's code).

``run(fn, ...)`` runs one Spark task per rank in a barrier stage, which Spark
schedules all at once or not at all (``task.py``). Each task starts a fresh
Python process for ``fn`` (``child.py``) with torchrun's variables set:
``RANK`` (the task's partition), ``WORLD_SIZE``, ``LOCAL_RANK`` (its rank
among the tasks on the same executor host), ``MASTER_ADDR`` (rank 0's
executor) and ``MASTER_PORT`` (where rank 0's task runs the job's process
manager, on a port it bound once and gave the others through Spark's own
barrier messaging, ``allGather``). ``kd.init()`` in ``fn`` then forms the job
with no arguments, and tensors go over shared memory and MPI as under
``kdrun``.

A secret made for each run travels in the tasks' closure: every rank proves
it to the process manager, and every task to the driver's relay, a port the
driver listens on for the tasks (``DriverRelay``): each task sends its
process's output line by line (written to the driver's ``stdout``/``stderr``
with a ``[rank]`` label) and, at the end, how the process ended
(``relay.py``). Results travel back with Spark's ``collect()``; when the stage
fails, the driver waits for every rank's report and raises one
``PeerFailureError`` that says rank by rank what happened. Which rank failed
first is the process manager's report, passed on by rank 0's task.

Importing this module imports no Spark.
"""

from __future__ import annotations

import base64
import functools
import pickle
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from keras_dist._runtime import wire
from keras_dist.clusters.common import new_secret
from keras_dist.clusters.spark import relay
from keras_dist.clusters.spark.task import Job, barrier_task
from keras_dist.errors import KerasDistError, PeerFailureError

__all__ = ["run"]

#: Once the stage failed, how long the driver waits for the ranks' reports.
#: Spark stops the other tasks of the stage itself (after
#: ``spark.python.task.killTimeout``, 2 s by default), which closes their
#: connections: this bound only matters when an executor cannot be reached.
_REPORT_WAIT_SECONDS = 15.0
#: Once the stage failed, how long the driver waits for a rank whose task has
#: not connected yet (a task that starts late, or cannot reach the driver).
_UNHEARD_WAIT_SECONDS = 3.0


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
        num_proc: int | None = None, start_timeout: float | None = None,
        env: Mapping[str, str] | None = None, stdout: TextIO | None = None,
        stderr: TextIO | None = None, verbose: int = 1) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` on ``num_proc`` Spark tasks as one keras_dist job.

    Uses the active ``SparkSession`` (classic Spark; Spark Connect has no
    barrier mode). Each task runs ``fn`` in a Python process of its own, in
    which ``kd.init()`` needs no arguments. ``fn``, its arguments and its
    results travel with cloudpickle, as Spark's own closures do.

    Example:

    ```python
    import keras_dist.spark

    def train(epochs):
        import keras_dist as kd
        kd.init()
        ...  # build, compile with kd.DistributedOptimizer, fit
        return kd.rank(), history.history["loss"][-1]

    results = keras_dist.spark.run(train, args=(3,), num_proc=4)
    ```

    Args:
        fn: the function each rank runs.
        args: positional arguments of ``fn``, the same on every rank.
        kwargs: keyword arguments of ``fn``, the same on every rank.
        num_proc: the number of processes (Spark tasks), each taking
            ``spark.task.cpus`` cores; the cluster must have that many free
            task slots at once. Default: the SparkContext's
            ``defaultParallelism``.
        start_timeout: seconds ``kd.init()`` waits for every rank to reach
            the rendezvous (sets ``KERAS_DIST_RENDEZVOUS_TIMEOUT`` in the
            processes). Default: that variable's value on the executors, else
            300.
        env: environment variables set in every process, on top of the
            executor's (Spark's ``spark.executorEnv.*``).
        stdout: where the processes' stdout is written, each line labelled
            ``[rank] ``. Default: ``sys.stdout``.
        stderr: where the processes' stderr, and this function's own lines,
            are written. Default: ``sys.stderr``.
        verbose: 0: only the processes' output; 1 or more: also a line when
            each process starts (its pid and host) and when the job ends.

    Returns:
        What ``fn`` returned, as a list in rank order.

    Raises:
        ImportError: PySpark is not installed.
        ValueError: an argument is out of range.
        RuntimeError: there is no active SparkSession, or it is a Spark
            Connect session.
        PeerFailureError: a rank failed (``fn`` raised, its process was
            killed or exited early); ``peer_rank`` is the rank that failed
            first (the job's process manager says which, through rank 0's
            task; without its report, the lowest rank that failed). The message
            says rank by rank how each ended, with ``fn``'s traceback or the
            last lines of its stderr; the exception ``fn`` raised on that rank
            is its ``__cause__``.
        KerasDistError: the Spark job failed before any rank did (Spark's
            reason in the message, its error as the ``__cause__``).
    """
    session_class = _import_spark_session()
    context = _spark_context(session_class)
    if num_proc is None:
        num_proc = context.defaultParallelism
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"`num_proc` must be a whole number >= 1. Received: num_proc={num_proc!r}")
    if start_timeout is not None and not start_timeout > 0:
        raise ValueError("`start_timeout` must be a number of seconds > 0. "
                         f"Received: start_timeout={start_timeout!r}")
    process_env = {str(name): str(value) for name, value in (env or {}).items()}
    if start_timeout is not None:
        process_env["KERAS_DIST_RENDEZVOUS_TIMEOUT"] = f"{start_timeout:g}"

    from pyspark import cloudpickle

    payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    secret = new_secret()  # one per run, in the tasks' closure
    driver_relay = DriverRelay(num_proc, secret, sys.stdout if stdout is None else stdout,
                        sys.stderr if stderr is None else stderr, verbose)
    job = Job(payload=payload, size=num_proc, env=process_env, secret=secret,
              driver=(context.getConf().get("spark.driver.host") or socket.gethostname(),
                      driver_relay.port))
    started = time.monotonic()
    try:
        try:
            gathered = (context.parallelize(range(num_proc), num_proc).barrier()
                        .mapPartitions(functools.partial(barrier_task, job)).collect())
        except Exception as error:  # noqa: BLE001 - Py4J's, Spark's: the reports say more
            driver_relay.wait_for_reports(_REPORT_WAIT_SECONDS, unheard=_UNHEARD_WAIT_SECONDS)
            failure, cause = driver_relay.failure(error)
            raise failure from cause
        driver_relay.wait_for_reports(_REPORT_WAIT_SECONDS)
    finally:
        driver_relay.stop()
    if verbose:
        driver_relay.say(f"{num_proc} processes finished in {time.monotonic() - started:.1f} s")
    return [pickle.loads(data) for _, data in sorted(gathered, key=lambda item: item[0])]


def _import_spark_session():
    try:
        from pyspark.sql import SparkSession
    except ImportError as error:
        raise ImportError("keras_dist.spark needs PySpark (3.5 or later): "
                          f"pip install 'pyspark>=3.5' ({error})") from None
    return SparkSession


def _spark_context(session_class):
    """The active session's SparkContext."""
    try:
        session = session_class.active()
    except Exception as error:  # noqa: BLE001 - PySpark's NO_ACTIVE_OR_DEFAULT_SESSION
        raise RuntimeError("keras_dist.spark.run needs an active SparkSession: create one "
                           "first (SparkSession.builder...getOrCreate()). "
                           f"PySpark said: {error}") from None
    try:
        return session.sparkContext
    except Exception as error:  # noqa: BLE001 - Spark Connect: JVM_ATTRIBUTE_NOT_SUPPORTED
        raise RuntimeError("keras_dist.spark.run needs a classic SparkSession: barrier mode "
                           "runs on RDDs, which a Spark Connect session does not offer. "
                           f"PySpark said: {error}") from None


class DriverRelay(wire.LineServer):
    """The driver's end: one selector loop in a thread of its own, serving only
    the tasks that prove the run's secret; writes their lines, keeps their
    outcomes."""

    line_bytes = relay.RECORD_BYTES

    def __init__(self, size: int, secret: str, stdout: TextIO, stderr: TextIO,
                 verbose: int) -> None:
        dual = socket.has_dualstack_ipv6()  # executors may reach the driver by either family
        listener = socket.create_server(
            ("", 0), family=socket.AF_INET6 if dual else socket.AF_INET, dualstack_ipv6=dual,
            backlog=1024)
        super().__init__(listener, secret.encode(), job=secrets.token_hex(8))
        self.port = listener.getsockname()[1]
        self.size = size
        self.streams = {"stdout": stdout, "stderr": stderr}
        self.verbose = verbose
        self.changed = threading.Condition()
        self.write_lock = threading.Lock()
        self.rank_of: dict[wire.Connection, int] = {}
        self.started: dict[int, dict] = {}
        self.outcomes: dict[int, dict] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="keras_dist-spark-relay",
                                       daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        try:
            while not self.stopping.is_set():
                self.step(0.2)
        finally:
            self.close_all(flush_seconds=0)

    def say(self, text: str) -> None:
        self._write("stderr", f"keras_dist.spark: {text}")

    def _write(self, stream: str, text: str) -> None:
        with self.write_lock:
            self.streams[stream].write(text + "\n")
            self.streams[stream].flush()

    # -- the tasks --------------------------------------------------------------
    def claimed(self, conn: wire.Connection, claim: dict[str, str]) -> None:
        rank = wire.whole(claim, "rank", 0, self.size - 1)
        if claim.get("cmd") != "kd_relay" or rank is None:
            self.close(conn)
            return
        with self.changed:
            self.rank_of[conn] = rank

    def received(self, conn: wire.Connection, line: bytes) -> None:
        record, rank = relay.decode(line), self.rank_of.get(conn)
        if record is None or rank is None:
            self.close(conn)
            return
        if isinstance(record.get("stream"), str) and record["stream"] in self.streams:
            self._write(record["stream"], f"[{rank}] {record.get('line', '')}")
        elif isinstance(record.get("started"), dict):
            self._started(rank, record["started"])
        elif isinstance(record.get("outcome"), dict):
            with self.changed:
                self.outcomes[rank] = record["outcome"]

    def lost(self, conn: wire.Connection) -> None:
        with self.changed:
            self.rank_of.pop(conn, None)
            self.changed.notify_all()

    def _started(self, rank: int, record: dict) -> None:
        with self.changed:
            self.started[rank] = record
            self.changed.notify_all()
        if self.verbose:
            self.say(f"rank {rank} of {self.size} started: pid {record.get('pid')} on "
                     f"{record.get('host')} (rendezvous {record.get('rendezvous')})")

    def wait_for_reports(self, timeout: float, unheard: float = 0.0) -> None:
        """Until every task that connected has reported and gone, or ``timeout``
        seconds; and, for at most ``unheard`` seconds, until every rank's task
        has connected.

        A task closes its connection before its result leaves it: once
        ``collect()`` returned, this only waits for the lines still in flight.
        """
        start = time.monotonic()
        deadline, unheard_deadline = start + timeout, start + min(unheard, timeout)
        with self.changed:
            while True:
                now = time.monotonic()
                everyone = len(self.started) == self.size or now >= unheard_deadline
                if now >= deadline or (not self.rank_of and everyone):
                    return
                self.changed.wait((deadline if everyone else unheard_deadline) - now)

    def failure(self, error: Exception) -> tuple[KerasDistError, BaseException | None]:
        """The error of a failed run (the rank that failed first, then every
        failed rank and how, in rank order) and what it is raised from: the
        exception fn raised on the rank that failed first, else nothing (the
        message says it all), or Spark's error when no rank reported."""
        with self.changed:
            failed = {rank: outcome for rank, outcome in self.outcomes.items()
                      if outcome.get("summary")}
            stopped = sorted(set(self.started) - set(self.outcomes))
            unheard = sorted(set(range(self.size)) - set(self.started))
        if not failed:
            return KerasDistError(f"keras_dist.spark.run: the Spark job failed before any rank "
                                  f"reported a failure: {_spark_reason(error)}"), error
        report = next((outcome["first_failure"] for outcome in failed.values()
                     if outcome.get("first_failure")), None)
        # Without the process manager's report (the job had not formed, or rank
        # 0's task did not fail or was stopped first): the lowest rank that
        # failed. Before the job forms, no rank ends because of another.
        first = report["rank"] if report else min(failed)
        what = failed[first]["summary"] if first in failed else report["message"]
        lines = [f"keras_dist.spark.run: rank {first} of {self.size} failed first ({what}); "
                 f"{len(failed)} of {self.size} ranks failed:"]
        lines += [relay.describe(rank, self.size, failed[rank]["where"], failed[rank]["summary"],
                            failed[rank]["details"]) for rank in sorted(failed)]
        lines += [f"rank {rank} of {self.size}: its Spark task was stopped before its process "
                  "ended (Spark stops every task of a barrier stage when one fails)"
                  for rank in stopped]
        lines += [f"rank {rank} of {self.size}: nothing heard from its Spark task (stopped before "
                  "it started its process, or it could not reach the driver)"
                  for rank in unheard]
        return PeerFailureError("\n".join(lines), peer_rank=first), _exception(failed.get(first))

    def stop(self) -> None:
        """Stops serving and closes every connection and the port."""
        self.stopping.set()
        self.thread.join()


def _exception(outcome: dict | None) -> BaseException | None:
    """The exception of a rank's outcome, if it travelled and the driver can load it."""
    data = (outcome or {}).get("exception")
    if not data:
        return None
    try:
        return pickle.loads(base64.b64decode(data))
    except Exception:  # noqa: BLE001 - a class the driver cannot import
        return None


def _spark_reason(error: Exception) -> str:
    """The first line of the JVM's exception (Py4J's own message is a call site)."""
    java = getattr(error, "java_exception", None)
    try:
        text = str(java.toString()) if java is not None else str(error)
    except Exception:  # noqa: BLE001 - a JVM already gone
        text = str(error)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
