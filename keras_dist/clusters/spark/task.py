"""The code of one Spark barrier task under ``keras_dist.spark.run``.

Each task finds its place from the stage's task infos (rank: its partition;
local rank: its rank among the tasks of the same executor host; rank 0's
host: where the others meet), starts its rank's process (``child.py``) with
torchrun's variables and the run's secret, relays the process's output and,
at the end, how it ended to the driver (``relay.py``), and yields what ``fn``
returned. Rank 0's task also runs the job's process manager, on a port it
binds once and hands to the other tasks through Spark's own barrier messaging
(``allGather``), and hears from it which rank failed first.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence

from keras_dist._runtime import wire
from keras_dist._runtime.placement import (
    MPI_LAUNCHER_VARIABLES,
    Placement,
    split_address,
    torchrun_variables,
)
from keras_dist.clusters.common import JobProcessManager, rank_environment
from keras_dist.clusters.spark import child, relay
from keras_dist.errors import KerasDistError

#: Lines of a failed process's stderr quoted in the error.
_STDERR_TAIL_LINES = 20
#: How long a task tries to reach the driver before it runs without relaying.
_CONNECT_SECONDS = 10.0
#: Once rank 0's process failed, how long its task waits for the process
#: manager's report of the rank that failed first (sent the moment it saw it).
_FIRST_FAILURE_REPORT_SECONDS = 5.0
#: How long a task waits for the last lines of its process once it ended.
_DRAIN_SECONDS = 10.0
#: Variables of torchrun's agent that would move the rendezvous port.
_TORCHRUN_AGENT_VARIABLES = ("TORCHELASTIC_USE_AGENT_STORE",)
#: Seconds the ranks have to meet when neither the run nor the executor says.
_DEFAULT_START_SECONDS = 300.0


@dataclasses.dataclass(frozen=True)
class Job:
    """What every task of one run needs (pickled into the task's closure).

    Attributes:
        payload: ``(fn, args, kwargs)``, cloudpickled by the driver.
        size: the number of ranks.
        env: variables set in every rank's process.
        secret: the run's secret: proves a task to the driver's relay, and
            every rank to the job's process manager.
        driver: where the driver's relay listens.
    """

    payload: bytes
    size: int
    env: Mapping[str, str]
    secret: str = dataclasses.field(repr=False)
    driver: tuple[str, int]


def place_from_addresses(rank: int, addresses: Sequence[str], port: int) -> Placement:
    """Where task ``rank`` stands, given every task's executor ``host:port`` in rank order.

    Local ranks count the tasks of the same host in rank order, as MPI numbers
    them; rank 0's host is where the others meet it.
    """
    hosts = [split_address(address, "address", "Spark's task infos")[0]
             for address in addresses]
    return Placement(rank=rank, size=len(hosts), host=hosts[0], port=port,
                     local_rank=hosts[:rank].count(hosts[rank]), source="Spark's task infos")


def process_environment(base: Mapping[str, str], job_env: Mapping[str, str], place: Placement,
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
    environment.update(torchrun_variables(place))
    paths = [environment.get("PYTHONPATH", ""), *task_path]
    environment["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path for path in paths if path))
    environment.setdefault("PYTHONUNBUFFERED", "1")  # lines reach the driver as printed
    return environment


def _start_seconds(job: Job) -> float:
    value = job.env.get("KERAS_DIST_RENDEZVOUS_TIMEOUT") or os.environ.get(
        "KERAS_DIST_RENDEZVOUS_TIMEOUT")
    try:
        return float(value) if value else _DEFAULT_START_SECONDS
    except ValueError:
        return _DEFAULT_START_SECONDS  # kd.init() in the rank names the bad value


def barrier_task(job: Job, _partition: Iterator[int]) -> Iterator[tuple[int, bytes]]:
    """One Spark barrier task: runs its rank's process, yields ``(rank, result)``."""
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    rank = context.partitionId()
    addresses = [info.address for info in context.getTaskInfos()]
    manager = None
    if rank == 0:  # Spark's barrier messaging hands its port to every task
        manager = JobProcessManager(job.size, _start_seconds(job), job.secret,
                                    env={**os.environ, **job.env})
    try:
        ports = context.allGather(str(manager.port if manager is not None else 0))
        place = place_from_addresses(rank, addresses, int(ports[0]))
        with TaskRelay(job, rank) as task_relay:
            outcome = _run_process(job, place, task_relay, manager)
            task_relay.report(outcome)
    finally:
        if manager is not None:
            manager.close()
    if outcome.summary is not None:
        raise KerasDistError(outcome.describe(rank, place.size))
    yield rank, outcome.result


class _FirstFailure:
    """Rank 0's task hears from the process manager, in a thread, which rank
    failed first."""

    def __init__(self, manager: JobProcessManager) -> None:
        self.failure: tuple[int | None, str] | None = None
        self.thread = threading.Thread(target=self._listen, args=(manager,),
                                       name="keras_dist-spark-first-failure", daemon=True)
        self.thread.start()

    def _listen(self, manager: JobProcessManager) -> None:
        self.failure = manager.first_failure()

    def report(self, timeout: float) -> dict | None:
        """``{"rank": R, "message": ...}`` once the manager named the rank that
        failed first; None when it did not within ``timeout`` seconds."""
        self.thread.join(timeout)
        if self.failure is None or self.failure[0] is None:
            return None
        return {"rank": self.failure[0], "message": self.failure[1]}


def _run_process(job: Job, place: Placement, task_relay: TaskRelay,
                 manager: JobProcessManager | None) -> relay.Outcome:
    workdir = tempfile.mkdtemp(prefix="keras_dist_spark_")
    try:
        with open(os.path.join(workdir, child.PAYLOAD), "wb") as file:
            file.write(job.payload)
        environment = process_environment(os.environ, job.env, place, sys.path)
        environment.update(rank_environment(job.secret))
        watch_read, watch_write = os.pipe()
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "keras_dist.clusters.spark.child", workdir,
                 str(watch_read)],
                env=environment, pass_fds=(watch_read,), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        finally:
            os.close(watch_read)
        try:
            host = socket.gethostname()
            task_relay.started(process.pid, host, place.address)
            tail: deque[str] = deque(maxlen=_STDERR_TAIL_LINES)
            pumps = [threading.Thread(target=_pump, args=(process.stdout, "stdout", task_relay,
                                                          None), daemon=True),
                     threading.Thread(target=_pump, args=(process.stderr, "stderr", task_relay,
                                                          tail), daemon=True)]
            for pump in pumps:
                pump.start()
            first = _FirstFailure(manager) if manager is not None else None
            status = process.wait()
            for pump in pumps:  # a process fn started may hold the pipes open longer
                pump.join(_DRAIN_SECONDS)
        finally:
            os.close(watch_write)  # the process ends itself if it is still there
        outcome = _read_outcome(workdir, status, f"pid {process.pid} on {host}", list(tail))
        if first is not None and outcome.summary is not None:
            outcome = dataclasses.replace(outcome,
                                          first_failure=first.report(_FIRST_FAILURE_REPORT_SECONDS))
        return outcome
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _pump(pipe, stream: str, task_relay: TaskRelay, tail: deque[str] | None) -> None:
    """Relays one of the process's output streams, line by line."""
    with pipe:
        for raw in pipe:
            line = raw.decode(errors="replace").rstrip("\n")
            if tail is not None:
                tail.append(line)
            task_relay.line(stream, line)


def _read_outcome(workdir: str, status: int, where: str,
                  stderr_tail: list[str]) -> relay.Outcome:
    """What the process left in ``workdir`` and how it exited, as one record."""
    result_path, failure_path = (os.path.join(workdir, name)
                                 for name in (child.RESULT, child.FAILURE))
    if os.path.exists(failure_path):
        with open(failure_path, "rb") as file:
            failure = pickle.load(file)  # written by this task's own process
        return relay.Outcome(where, summary=failure["summary"],
                             details=failure["traceback"].rstrip(), raised=failure["in_fn"],
                             exception=failure["exception"])
    if status == 0 and os.path.exists(result_path):
        with open(result_path, "rb") as file:
            return relay.Outcome(where, result=file.read())
    if status < 0:
        try:
            summary = f"killed by {signal.Signals(-status).name}"
        except ValueError:
            summary = f"killed by signal {-status}"
    else:
        summary = f"exited with status {status} before fn returned"
    quoted = "".join(f"\n    {line}" for line in stderr_tail)
    return relay.Outcome(where, summary=summary,
                         details=f"the last lines of its stderr:{quoted}" if quoted
                         else "its stderr is empty")


class TaskRelay:
    """A task's connection to the driver: its process's lines, then its outcome.

    When the driver cannot be reached (or does not prove the run's secret),
    the task runs all the same and writes the lines to its own stdout/stderr
    (the executor's log).
    """

    def __init__(self, job: Job, rank: int) -> None:
        self.rank = rank
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        try:
            sock, _ = wire.connect(job.driver, job.secret.encode(), "kd_relay", {"rank": rank},
                                   time.monotonic() + _CONNECT_SECONDS)
            sock.settimeout(None)
            self.sock = sock
        except OSError as error:
            sys.stderr.write(f"keras_dist.spark: rank {rank} cannot reach the driver at "
                             f"{job.driver[0]}:{job.driver[1]} ({error}); its output stays in "
                             "this executor's log\n")

    def __enter__(self) -> TaskRelay:
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
                self.sock.sendall(relay.encode(record))
                return True
            except OSError:
                self.sock.close()
                self.sock = None
                return False

    def started(self, pid: int, host: str, rendezvous_address: str) -> None:
        self._send({"started": {"pid": pid, "host": host, "rendezvous": rendezvous_address}})

    def line(self, stream: str, text: str) -> None:
        if not self._send(relay.output_line(stream, text)):
            target = sys.stdout if stream == "stdout" else sys.stderr
            target.write(f"[{self.rank}] {text}\n")
            target.flush()

    def report(self, outcome: relay.Outcome) -> None:
        self._send({"outcome": outcome.record()})
