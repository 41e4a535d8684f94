"""Run a function as one keras_dist job on a Spark cluster, in barrier execution mode.

``run(fn, ...)`` runs one Spark task per rank in a barrier stage, which Spark
schedules all at once or not at all. Each task starts a fresh Python process
for ``fn`` (Spark reuses its Python workers from task to task, and MPI starts
only once in a process) with torchrun's variables set: ``RANK`` (the task's
partition), ``WORLD_SIZE``, ``LOCAL_RANK`` (its rank among the tasks on the
same executor host), ``MASTER_ADDR`` (rank 0's executor) and ``MASTER_PORT``
(a free port that rank 0's task picked and gave the others through Spark's own
barrier messaging, ``allGather``). ``kd.init()`` in ``fn`` then forms the job
with no arguments (``keras_dist._runtime.rendezvous``), and tensors go over
shared memory and MPI as under ``kdrun``.

The driver listens on a port of its own for the tasks: each one connects,
proves it belongs to this run with a token that travels in the task's closure,
and sends its process's output line by line (written to the driver's
``stdout``/``stderr`` with a ``[rank]`` label) and, at the end, how the
process ended. Results travel back with Spark's ``collect()``; when the stage
fails, the driver waits for every rank's report and raises one
``PeerFailureError`` that says rank by rank what happened. Which rank failed
first is the job's process manager's word: rank 0's task listens to it
(``kd_watch``, as each rank does) and passes it on in its report.

A process whose task is gone (Spark ends every task of a barrier stage when
one fails, or an executor died) ends itself: it holds the read end of a pipe
whose write end only its task holds, and a thread of its own waits for that
pipe to close.

Importing this module imports no Spark. ``python -m keras_dist.spark WORKDIR
FD`` is the process a task starts: it loads ``fn`` from ``WORKDIR``, calls it
and writes what it returned, or raised, back there.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hmac
import json
import os
import pickle
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TextIO

from keras_dist._runtime import rendezvous
from keras_dist._runtime.placement import MPI_LAUNCHER_VARIABLES
from keras_dist.errors import KerasDistError, PeerFailureError

__all__ = ["run"]

#: Files a rank's process reads and writes in its task's private directory.
_PAYLOAD, _RESULT, _FAILURE = "payload.pkl", "result.pkl", "failure.pkl"
#: Lines of a failed process's stderr quoted in the error.
_STDERR_TAIL_LINES = 20
#: Once the stage failed, how long the driver waits for the ranks' reports.
#: Spark stops the other tasks of the stage itself (after
#: ``spark.python.task.killTimeout``, 2 s by default), which closes their
#: connections: this bound only matters when an executor cannot be reached.
_REPORT_WAIT_SECONDS = 15.0
#: Once the stage failed, how long the driver waits for a rank whose task has
#: not connected yet (a task that starts late, or cannot reach the driver).
_UNHEARD_WAIT_SECONDS = 3.0
#: How long a task tries to reach the driver before it runs without relaying.
_CONNECT_SECONDS = 10.0
#: Once rank 0's process failed, how long its task waits for the process
#: manager's word on which rank failed first (sent the moment it saw it).
_FIRST_FAILURE_WORD_SECONDS = 5.0
#: Pause between rank 0's task's attempts to reach the process manager, which
#: listens from the moment fn calls kd.init().
_WATCH_RETRY_SECONDS = 0.1
#: How long a task waits for the last lines of its process once it ended.
_DRAIN_SECONDS = 10.0
#: The longest first line the driver reads from a connection that has not shown the token.
_GREETING_BYTES = 4096
#: Variables of torchrun's agent that would move the rendezvous port.
_TORCHRUN_AGENT_VARIABLES = ("TORCHELASTIC_USE_AGENT_STORE",)


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
            task; without its word, the lowest rank that failed). The message
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
    relay = _DriverRelay(num_proc, sys.stdout if stdout is None else stdout,
                         sys.stderr if stderr is None else stderr, verbose)
    job = _Job(payload=payload, size=num_proc, env=process_env, token=relay.token,
               driver=(context.getConf().get("spark.driver.host") or socket.gethostname(),
                       relay.port))
    started = time.monotonic()
    try:
        try:
            gathered = (context.parallelize(range(num_proc), num_proc).barrier()
                        .mapPartitions(functools.partial(_barrier_task, job)).collect())
        except Exception as error:  # noqa: BLE001 - Py4J's, Spark's: the reports say more
            relay.wait_for_reports(_REPORT_WAIT_SECONDS, unheard=_UNHEARD_WAIT_SECONDS)
            failure, cause = relay.failure(error)
            raise failure from cause
        relay.wait_for_reports(_REPORT_WAIT_SECONDS)
    finally:
        relay.close()
    if verbose:
        relay.say(f"{num_proc} processes finished in {time.monotonic() - started:.1f} s")
    return [pickle.loads(data) for _, data in sorted(gathered, key=lambda item: item[0])]


def _import_spark_session():
    try:
        from pyspark.sql import SparkSession
    except ImportError as error:
        raise ImportError("keras_dist.spark needs PySpark (3.5 or later): "
                          f"pip install keras-dist[spark] ({error})") from None
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


@dataclasses.dataclass(frozen=True)
class _Job:
    """What every task of one run needs (pickled into the task's closure).

    Attributes:
        payload: ``(fn, args, kwargs)``, cloudpickled by the driver.
        size: the number of ranks.
        env: variables set in every rank's process.
        token: what a task shows the driver's relay to be heard.
        driver: where the driver's relay listens.
    """

    payload: bytes
    size: int
    env: Mapping[str, str]
    token: str
    driver: tuple[str, int]


@dataclasses.dataclass(frozen=True)
class _Place:
    """A task's place in the job, decided from the barrier stage's task infos."""

    rank: int
    size: int
    local_rank: int
    master_host: str
    master_port: int

    def variables(self) -> dict[str, str]:
        """torchrun's variables, which ``kd.init()`` reads."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.size),
                "LOCAL_RANK": str(self.local_rank), "MASTER_ADDR": self.master_host,
                "MASTER_PORT": str(self.master_port)}


def _host(address: str) -> str:
    """``"10.0.0.5:40123"`` -> ``"10.0.0.5"``; ``"[::1]:40123"`` -> ``"::1"``."""
    return address.rpartition(":")[0].strip("[]") or address


def _place_from_addresses(rank: int, addresses: Sequence[str], master_port: int) -> _Place:
    """Where task ``rank`` stands, given every task's executor ``host:port`` in rank order.

    Local ranks count the tasks of the same host in rank order, as MPI numbers
    them; rank 0's host is where the others meet it.
    """
    hosts = [_host(address) for address in addresses]
    return _Place(rank=rank, size=len(hosts), local_rank=hosts[:rank].count(hosts[rank]),
                  master_host=hosts[0], master_port=master_port)


def _process_environment(base: Mapping[str, str], job_env: Mapping[str, str], place: _Place,
                        task_path: Iterable[str]) -> dict[str, str]:
    """The environment of a rank's process.

    The executor's, less the variables that would make ``kd.init()`` look
    elsewhere (an MPI launcher's, torchrun's agent's); then the run's ``env``;
    then torchrun's variables for this rank. ``PYTHONPATH`` ends with the
    task's own ``sys.path``, so that what Spark made importable in the task
    (``addPyFile``, ``--py-files``) is importable in the process too.
    """
    environment = {name: value for name, value in base.items()
                   if name not in MPI_LAUNCHER_VARIABLES and name not in _TORCHRUN_AGENT_VARIABLES}
    environment.update(job_env)
    environment.update(place.variables())
    paths = [environment.get("PYTHONPATH", ""), *task_path]
    environment["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path for path in paths if path))
    environment.setdefault("PYTHONUNBUFFERED", "1")  # lines reach the driver as printed
    return environment


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _barrier_task(job: _Job, _partition: Iterator[int]) -> Iterator[tuple[int, bytes]]:
    """One Spark barrier task: runs its rank's process, yields ``(rank, result)``."""
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    rank = context.partitionId()
    addresses = [info.address for info in context.getTaskInfos()]
    # Rank 0 picks the port; Spark's barrier messaging hands it to every task.
    ports = context.allGather(str(_free_port() if rank == 0 else 0))
    place = _place_from_addresses(rank, addresses, int(ports[0]))
    with _TaskRelay(job, rank) as relay:
        outcome = _run_process(job, place, relay)
        relay.report(outcome)
    if outcome.summary is not None:
        raise KerasDistError(outcome.describe(rank, place.size))
    yield rank, outcome.result


@dataclasses.dataclass(frozen=True)
class _Outcome:
    """How one rank's process ended.

    Attributes:
        where: ``"pid P on HOST"``.
        result: what ``fn`` returned, pickled, when it returned.
        summary: how the process failed, in one line (None when it did not):
            ``"fn raised ValueError: ..."``, ``"killed by SIGKILL"``, ...
        details: ``fn``'s traceback, or the last lines of the process's stderr.
        raised: ``fn`` raised an exception (rather than the process dying).
        exception: the exception ``fn`` raised, cloudpickled, when it can be.
        first_failure: rank 0's task only: the process manager's word on the
            rank that failed first, ``{"rank": R, "message": ...}``.
    """

    where: str
    result: bytes | None = None
    summary: str | None = None
    details: str = ""
    raised: bool = False
    exception: bytes | None = None
    first_failure: dict | None = None

    def describe(self, rank: int, size: int) -> str:
        return _describe(rank, size, self.where, self.summary, self.details)

    def record(self) -> dict:
        """What the driver is told (JSON)."""
        exception = self.exception
        return {"where": self.where, "summary": self.summary, "details": self.details,
                "raised": self.raised, "first_failure": self.first_failure,
                "exception": None if exception is None else base64.b64encode(exception).decode()}


def _describe(rank: int, size: int, where: str, summary: str | None, details: str) -> str:
    return f"rank {rank} of {size} ({where}): {summary}" + (f"\n{details}" if details else "")


def _run_process(job: _Job, place: _Place, relay: _TaskRelay) -> _Outcome:
    workdir = tempfile.mkdtemp(prefix="keras_dist_spark_")
    try:
        with open(os.path.join(workdir, _PAYLOAD), "wb") as file:
            file.write(job.payload)
        environment = _process_environment(os.environ, job.env, place, sys.path)
        watch_read, watch_write = os.pipe()
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "keras_dist.spark", workdir, str(watch_read)],
                env=environment, pass_fds=(watch_read,), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        finally:
            os.close(watch_read)
        try:
            host = socket.gethostname()
            relay.started(process.pid, host, f"{place.master_host}:{place.master_port}")
            tail: deque[str] = deque(maxlen=_STDERR_TAIL_LINES)
            pumps = [threading.Thread(target=_pump, args=(process.stdout, "stdout", relay, None),
                                      daemon=True),
                     threading.Thread(target=_pump, args=(process.stderr, "stderr", relay, tail),
                                      daemon=True)]
            for pump in pumps:
                pump.start()
            watch = _FirstFailureWatch(place.master_port, process) if place.rank == 0 else None
            status = process.wait()
            for pump in pumps:  # a process fn started may hold the pipes open longer
                pump.join(_DRAIN_SECONDS)
        finally:
            os.close(watch_write)  # the process ends itself if it is still there
        outcome = _outcome(workdir, status, f"pid {process.pid} on {host}", list(tail))
        if watch is not None and outcome.summary is not None:
            outcome = dataclasses.replace(outcome,
                                          first_failure=watch.word(_FIRST_FAILURE_WORD_SECONDS))
        return outcome
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _pump(pipe, stream: str, relay: _TaskRelay, tail: deque[str] | None) -> None:
    """Relays one of the process's output streams, line by line."""
    with pipe:
        for raw in pipe:
            line = raw.decode(errors="replace").rstrip("\n")
            if tail is not None:
                tail.append(line)
            relay.line(stream, line)


def _outcome(workdir: str, status: int, where: str, stderr_tail: list[str]) -> _Outcome:
    """What the process left in ``workdir`` and how it exited, as one record."""
    result_path, failure_path = (os.path.join(workdir, name) for name in (_RESULT, _FAILURE))
    if os.path.exists(failure_path):
        with open(failure_path, "rb") as file:
            failure = pickle.load(file)
        return _Outcome(where, summary=failure["summary"],
                        details=failure["traceback"].rstrip(), raised=failure["in_fn"],
                        exception=failure["exception"])
    if status == 0 and os.path.exists(result_path):
        with open(result_path, "rb") as file:
            return _Outcome(where, result=file.read())
    if status < 0:
        try:
            summary = f"killed by {signal.Signals(-status).name}"
        except ValueError:
            summary = f"killed by signal {-status}"
    else:
        summary = f"exited with status {status} before fn returned"
    quoted = "".join(f"\n    {line}" for line in stderr_tail)
    return _Outcome(where, summary=summary,
                    details=f"the last lines of its stderr:{quoted}" if quoted
                    else "its stderr is empty")


class _FirstFailureWatch:
    """Rank 0's task listens to the job's process manager as each rank does
    (``rendezvous.watch``), to hear which rank failed first. The manager runs
    in rank 0's process from ``kd.init()`` on, on this machine."""

    def __init__(self, port: int, process: subprocess.Popen) -> None:
        self.port = port
        self.process = process
        self.failure: tuple[int | None, str] | None = None
        self.thread = threading.Thread(target=self._listen, name="keras_dist-spark-first-failure",
                                       daemon=True)
        self.thread.start()

    def _listen(self) -> None:
        while self.process.poll() is None:
            try:
                sock = rendezvous.watch("127.0.0.1", self.port, timeout=1.0)
                break
            except OSError:
                time.sleep(_WATCH_RETRY_SECONDS)
        else:
            return  # the process ended without starting a job
        with sock:
            self.failure = rendezvous.wait_for_failure(sock)

    def word(self, timeout: float) -> dict | None:
        """``{"rank": R, "message": ...}`` once the manager named the rank that
        failed first; None when it did not within ``timeout`` seconds."""
        self.thread.join(timeout)
        if self.failure is None or self.failure[0] is None:
            return None
        return {"rank": self.failure[0], "message": self.failure[1]}


class _TaskRelay:
    """A task's connection to the driver: its process's lines, then its outcome.

    When the driver cannot be reached, the task runs all the same and writes
    the lines to its own stdout/stderr (the executor's log).
    """

    def __init__(self, job: _Job, rank: int) -> None:
        self.rank = rank
        self.token = job.token
        self.lock = threading.Lock()
        try:
            self.sock: socket.socket | None = socket.create_connection(
                job.driver, timeout=_CONNECT_SECONDS)
            self.sock.settimeout(None)
        except OSError as error:
            self.sock = None
            sys.stderr.write(f"keras_dist.spark: rank {rank} cannot reach the driver at "
                             f"{job.driver[0]}:{job.driver[1]} ({error}); its output stays in "
                             "this executor's log\n")

    def __enter__(self) -> _TaskRelay:
        return self

    def __exit__(self, *exc_info) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _send(self, record: dict) -> bool:
        with self.lock:
            if self.sock is None:
                return False
            try:
                self.sock.sendall(json.dumps(record).encode() + b"\n")
                return True
            except OSError:
                self.sock.close()
                self.sock = None
                return False

    def started(self, pid: int, host: str, rendezvous: str) -> None:
        self._send({"token": self.token, "rank": self.rank, "pid": pid, "host": host,
                    "rendezvous": rendezvous})

    def line(self, stream: str, text: str) -> None:
        if not self._send({"stream": stream, "line": text}):
            target = sys.stdout if stream == "stdout" else sys.stderr
            target.write(f"[{self.rank}] {text}\n")
            target.flush()

    def report(self, outcome: _Outcome) -> None:
        self._send({"outcome": outcome.record()})


class _DriverRelay:
    """The driver's end: writes the ranks' lines, keeps their outcomes."""

    def __init__(self, size: int, stdout: TextIO, stderr: TextIO, verbose: int) -> None:
        self.size = size
        self.streams = {"stdout": stdout, "stderr": stderr}
        self.verbose = verbose
        self.token = secrets.token_hex(16)
        dual = socket.has_dualstack_ipv6()  # executors may reach the driver by either family
        self.listener = socket.create_server(
            ("", 0), family=socket.AF_INET6 if dual else socket.AF_INET, dualstack_ipv6=dual,
            backlog=max(64, size))
        self.port = self.listener.getsockname()[1]
        self.changed = threading.Condition()
        self.write_lock = threading.Lock()
        #: Connections accepted and not closed yet.
        self.open_connections = 0
        self.started: dict[int, dict] = {}
        self.outcomes: dict[int, dict] = {}
        threading.Thread(target=self._accept, name="keras_dist-spark-relay", daemon=True).start()

    def say(self, text: str) -> None:
        self._write("stderr", f"keras_dist.spark: {text}")

    def _write(self, stream: str, text: str) -> None:
        with self.write_lock:
            self.streams[stream].write(text + "\n")
            self.streams[stream].flush()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return  # closed
            with self.changed:
                self.open_connections += 1
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        try:
            with connection, connection.makefile("rb") as lines:
                connection.settimeout(_CONNECT_SECONDS)  # for the greeting
                greeting = json.loads(lines.readline(_GREETING_BYTES))
                if not hmac.compare_digest(str(greeting.get("token", "")), self.token):
                    return  # not one of this run's tasks
                connection.settimeout(None)
                rank = int(greeting["rank"])
                self._started(rank, greeting)
                for raw in lines:
                    record = json.loads(raw)
                    if "stream" in record:
                        self._write(record["stream"], f"[{rank}] {record['line']}")
                    elif "outcome" in record:
                        with self.changed:
                            self.outcomes[rank] = record["outcome"]
        except (OSError, ValueError, KeyError, AttributeError):
            pass
        finally:
            with self.changed:
                self.open_connections -= 1
                self.changed.notify_all()

    def _started(self, rank: int, record: dict) -> None:
        with self.changed:
            self.started[rank] = record
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
                if now >= deadline or (not self.open_connections and everyone):
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
        word = next((outcome["first_failure"] for outcome in failed.values()
                     if outcome.get("first_failure")), None)
        # Without the process manager's word (the job had not formed, or rank
        # 0's task did not fail or was stopped first): the lowest rank that
        # failed. Before the job forms, no rank ends because of another.
        first = word["rank"] if word else min(failed)
        what = failed[first]["summary"] if first in failed else word["message"]
        lines = [f"keras_dist.spark.run: rank {first} of {self.size} failed first ({what}); "
                 f"{len(failed)} of {self.size} ranks failed:"]
        lines += [_describe(rank, self.size, failed[rank]["where"], failed[rank]["summary"],
                            failed[rank]["details"]) for rank in sorted(failed)]
        lines += [f"rank {rank} of {self.size}: its Spark task was stopped before its process "
                  "ended (Spark stops every task of a barrier stage when one fails)"
                  for rank in stopped]
        lines += [f"rank {rank} of {self.size}: no word from its Spark task (stopped before "
                  "it started its process, or it could not reach the driver)"
                  for rank in unheard]
        return PeerFailureError("\n".join(lines), peer_rank=first), _exception(failed.get(first))

    def close(self) -> None:
        self.listener.close()


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


# -- the process a task starts: ``python -m keras_dist.spark WORKDIR FD`` ------------------


def _end_with_task(watch_fd: int, workdir: str) -> None:
    """Ends this process once its task is gone (the pipe's write end closed),
    removing the task's directory, which the task no longer can."""
    try:
        while os.read(watch_fd, 1):
            pass
    except OSError:
        return  # fn closed the descriptor: nothing left to watch
    shutil.rmtree(workdir, ignore_errors=True)
    os._exit(1)


def _write_atomically(path: str, data: bytes) -> None:
    with open(path + ".part", "wb") as file:
        file.write(data)
    os.replace(path + ".part", path)


def _process_main(argv: Sequence[str]) -> None:
    """Loads ``fn`` from ``WORKDIR``, calls it, writes its result or its failure there.

    An exception ``fn`` raises is recorded, then raised on: after ``kd.init()``
    keras_dist's excepthook ends the whole job with it, as under kdrun.
    """
    workdir, watch_fd = argv[0], int(argv[1])
    threading.Thread(target=_end_with_task, args=(watch_fd, workdir),
                     name="keras_dist-spark-task-watch", daemon=True).start()
    from pyspark import cloudpickle

    with open(os.path.join(workdir, _PAYLOAD), "rb") as file:
        fn, args, kwargs = pickle.load(file)
    try:
        result = fn(*args, **kwargs)
    except BaseException as error:
        _record_failure(workdir, error, "fn raised", in_fn=True)
        raise
    try:
        data = cloudpickle.dumps(result)
    except Exception as error:
        _record_failure(workdir, error, "fn returned a value that cannot be pickled:",
                        in_fn=False)
        raise
    _write_atomically(os.path.join(workdir, _RESULT), data)


def _record_failure(workdir: str, error: BaseException, what: str, *, in_fn: bool) -> None:
    from pyspark import cloudpickle

    try:
        exception = cloudpickle.dumps(error)
    except Exception:  # noqa: BLE001 - an exception that cannot travel: its text does
        exception = None
    summary = "".join(traceback.format_exception_only(type(error), error)).strip()
    # fn's exception from fn's own frame on; a pickling error whole.
    frames = error.__traceback__.tb_next if in_fn else error.__traceback__
    _write_atomically(os.path.join(workdir, _FAILURE), pickle.dumps({
        "summary": f"{what} {summary}", "in_fn": in_fn, "exception": exception,
        "traceback": "".join(traceback.format_exception(type(error), error, frames))}))


if __name__ == "__main__":
    _process_main(sys.argv[1:])
