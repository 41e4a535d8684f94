"""Processes that a cluster started form one MPI job, with no mpiexec and no ssh.

Rank 0 starts the job's process manager (``pmi_server.py``, PMI-1 as MPICH's
own Hydra speaks it) on the rendezvous port; every rank connects to it, greets
it with its rank and the job's size, and once all have come hands the
connection to MPICH as ``PMI_FD``, exactly as Hydra hands its own. ``MPI_Init``
then builds ``MPI_COMM_WORLD`` across all of them, and everything above
(the shared-memory engine among ranks of one machine, MPI or NCCL across
machines, process sets, fail-fast) is what ``kdrun`` gives.

Each rank also keeps a second connection on which a daemon thread listens:
when any rank dies or aborts, the server says so there, and this rank writes
one line naming that rank and ends (Hydra kills the survivors in the same
case under mpiexec).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from urllib.parse import unquote

from keras_dist._runtime import procfs, wire
from keras_dist._runtime.placement import Placement
from keras_dist.errors import RendezvousError

_SERVER = str(Path(__file__).with_name("pmi_server.py"))
#: Seconds between attempts to reach a rendezvous that is not listening yet
#: (rank 0 may start after the others: pods, actors and tasks start in any order).
_RETRY_SECONDS = (0.05, 1.0)
#: The variables that may hold the job's secret; a rank removes them from its
#: environment, so processes it starts do not inherit the secret.
SECRET_VARIABLES = ("KERAS_DIST_SECRET", "KERAS_DIST_SECRET_FILE")

@dataclasses.dataclass
class ProcessManager:
    """A running process manager (``pmi_server.py``) and the pipe that keeps it:
    closing the pipe before every rank came calls the start off."""

    process: subprocess.Popen
    port: int
    pipe: int | None

    def release(self) -> None:
        """Lets the manager go on alone: it ends with the job (or, if the job
        never starts, when its start-up timeout passes)."""
        if self.pipe is not None:
            os.close(self.pipe)
            self.pipe = None

    def wait(self, timeout: float | None = None) -> int | None:
        """Its exit status, or None if it still runs after ``timeout`` seconds."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


def listen(host: str = "", port: int = 0, backlog: int = 1024) -> socket.socket:
    """A listening socket for a job's process manager, bound once (port 0: any
    free port) and handed to ``start_process_manager``: never probed, released
    and bound again."""
    return socket.create_server((host, port), backlog=backlog)


def start_process_manager(listener: socket.socket, size: int, timeout: float,
                          secret: bytes, env: dict[str, str] | None = None) -> ProcessManager:
    """Starts the job's process manager on ``listener`` (which this process
    then closes: the manager holds it). The secret goes down a pipe, never on
    a command line or in an environment; the pipe stays open while this
    process lives, unless ``ProcessManager.release`` closes it. ``env``: the
    manager's environment (default: this process's), less any secret."""
    read_end, write_end = os.pipe()
    try:
        process = subprocess.Popen(
            [sys.executable, _SERVER, "--fd", str(listener.fileno()), "--size", str(size),
             "--timeout", str(timeout)],
            pass_fds=(listener.fileno(),), stdin=read_end, stdout=subprocess.DEVNULL,
            close_fds=True, env={name: value for name, value in (env or os.environ).items()
                                 if name not in SECRET_VARIABLES})
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    os.write(write_end, secret.hex().encode() + b"\n")
    port = listener.getsockname()[1]
    listener.close()
    return ProcessManager(process, port, write_end)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _serve_here(placement: Placement, timeout: float, secret: bytes) -> None:
    """Rank 0: listens on the rendezvous port and starts the process manager there
    (on the loopback interface only, when that is where the job meets)."""
    loopback = _is_loopback(placement.host)
    if not secret and not loopback:
        warnings.warn(
            f"keras_dist: the rendezvous port {placement.port} of this job is open to anyone "
            f"who can reach this machine ({placement.source} give {placement.address}, not a "
            "loopback address), and the job has no secret: such a process can stop the job "
            "from starting or join it. Set KERAS_DIST_SECRET (or KERAS_DIST_SECRET_FILE) to "
            "the same random value on every rank (see the security page of the docs).",
            RuntimeWarning, stacklevel=5)  # kd.init()'s caller
    try:
        listener = listen("127.0.0.1" if loopback else "", placement.port)
    except OSError as error:
        raise RendezvousError(
            f"rank 0 cannot listen on port {placement.port} for the rendezvous "
            f"{placement.address} ({placement.source}): {error}") from None
    start_process_manager(listener, placement.size, timeout, secret)


def _unreachable(placement: Placement, timeout: float, error: BaseException | None):
    return RendezvousError(
        f"rank {placement.rank} of {placement.size} could not reach the rendezvous at "
        f"{placement.address} ({placement.source}) within {timeout:g} s "
        f"(KERAS_DIST_RENDEZVOUS_TIMEOUT): {error}. Rank 0 listens there from its kd.init() "
        "on.")


def _secrets_differ(placement: Placement) -> RendezvousError:
    return RendezvousError(
        f"rank {placement.rank} of {placement.size}: the rendezvous at {placement.address} "
        f"({placement.source}) and this rank hold different secrets: set the same "
        "KERAS_DIST_SECRET (or KERAS_DIST_SECRET_FILE) on every rank, or on none.")


def _connect(host: str, placement: Placement, deadline: float, timeout: float, secret: bytes,
             cmd: str, claim: dict) -> tuple[socket.socket, wire.LineReader]:
    """A connection to the process manager that has proved the secret both
    ways (``wire.connect``: it tries again until ``deadline``)."""
    try:
        return wire.connect((host, placement.port), secret, cmd, claim, deadline,
                            _RETRY_SECONDS)
    except wire.ForeignServerError as error:
        raise RendezvousError(
            f"rank {placement.rank} of {placement.size}: what listens at {placement.address} "
            f"({placement.source}) is not a keras_dist rendezvous: {error}") from None
    except (wire.DeniedError, wire.UnprovenError):
        raise _secrets_differ(placement) from None
    except OSError as error:
        raise _unreachable(placement, timeout, error) from None


def _greet(host: str, placement: Placement, deadline: float, timeout: float,
           secret: bytes) -> socket.socket:
    """Says who this rank is and waits until every rank has come."""
    claim = {"rank": placement.rank, "size": placement.size, "host": socket.gethostname(),
             "pid": os.getpid()}
    sock, reader = _connect(host, placement, deadline, timeout, secret, "kd_hello", claim)
    try:
        # The server gives up at the timeout and says which ranks are missing:
        # wait a little longer, to hear that rather than guess.
        try:
            line = reader.line(deadline + 5.0)
        except TimeoutError:
            line = b""
        sock.settimeout(None)
        fields = wire.parse_line(line or b"")
        if fields.get("cmd") == "kd_ready" and not reader.buffer:
            return sock
        if fields.get("cmd") == "kd_refuse":
            raise RendezvousError(f"the rendezvous at {placement.address} ({placement.source}) "
                                  f"refused to start the job: "
                                  f"{unquote(fields.get('message', ''))}")
        what = ("closed the connection" if line is None
                else f"did not start the job within {timeout:g} s")
        raise RendezvousError(
            f"rank {placement.rank} of {placement.size}: the rendezvous at "
            f"{placement.address} ({placement.source}) {what} "
            "(KERAS_DIST_RENDEZVOUS_TIMEOUT); its rank 0 may have ended.")
    except BaseException:
        sock.close()
        raise


def join(placement: Placement, timeout: float, secret: bytes = b"",
         served_by_launcher: bool = False) -> None:
    """Meets the other ranks; MPI, initialised next, forms the job with them.

    Must run before ``mpi4py.MPI`` is imported in this process.

    Args:
        placement: where this rank stands and where the job meets.
        timeout: seconds to wait for every rank.
        secret: the job's secret (empty: none), which every connection proves.
        served_by_launcher: the process manager runs already (Ray's and
            Spark's executors start it): rank 0 connects to it like the others.

    Raises:
        RendezvousError: the rendezvous cannot be reached, refuses this
            process (another world size, a rank taken twice, another secret),
            or not every rank came within ``timeout`` seconds; the message
            names what was waited for.
    """
    deadline = time.monotonic() + timeout
    if placement.rank == 0 and not served_by_launcher:
        _serve_here(placement, timeout, secret)
        host = "127.0.0.1"
    else:
        host = placement.host
    sock = _greet(host, placement, deadline, timeout, secret)
    # MPICH's PMI client takes the connection over, as it takes Hydra's.
    os.environ.update(PMI_FD=str(sock.detach()), PMI_RANK=str(placement.rank),
                      PMI_SIZE=str(placement.size))
    threading.Thread(target=_watch, args=(host, placement, secret),
                     name="keras_dist-rendezvous-watch", daemon=True).start()


def mpi_started() -> None:
    """Once MPI is up: processes this one starts are not part of the job."""
    for name in ("PMI_FD", "PMI_RANK", "PMI_SIZE"):
        os.environ.pop(name, None)


def watch(host: str, port: int, secret: bytes, rank: int = -1,
          timeout: float = 30.0) -> socket.socket:
    """A connection on which the job's process manager at ``host:port`` will
    say which rank failed first (``wait_for_failure``). ``rank``: the watching
    rank, or -1 for a watcher that is not one (an executor that outlives the
    ranks, to name the failed one). ``secret``: the job's.

    Raises:
        OSError: the process manager cannot be reached within ``timeout``
            seconds, or refused the proof.
    """
    # Watching from the welcome on: a failure after it is told here. A busy
    # server may drop the connection before the proof: it is tried again.
    sock, _ = wire.connect((host, port), secret, "kd_watch", {"rank": rank},
                           time.monotonic() + timeout, _RETRY_SECONDS)
    sock.settimeout(None)
    return sock


def wait_for_failure(sock: socket.socket) -> tuple[int | None, str] | None:
    """Blocks until the job ends: ``(rank, what happened)`` when the process
    manager names the rank that failed first, None when it ended without a
    word (the job finished, or the manager died with rank 0)."""
    try:
        line = wire.LineReader(sock).line(None)
    except OSError:
        return None
    fields = wire.parse_line(line or b"")
    if fields.get("cmd") != "kd_abort":
        return None
    rank = wire.whole(fields, "rank", -1, 1 << 24)
    return rank, unquote(fields.get("message", ""))


def _watch(host: str, placement: Placement, secret: bytes) -> None:
    """Ends this rank when the server says another rank died or aborted."""
    try:
        failure = wait_for_failure(watch(host, placement.port, secret, placement.rank))
    except OSError as error:
        failure = None, f"the job's rendezvous at {placement.address} cannot be watched: {error}"
    if _mpi_finalized():
        return
    if failure is not None and failure[0] == placement.rank:
        return  # this rank aborted the job: it ends on its own
    if failure is not None:
        reason = failure[1]
    else:
        reason = (f"the job's rendezvous at {placement.address} (run by rank 0) ended "
                  "without a word: rank 0 or its process manager died")
    sys.stderr.write(f"[keras_dist rank {placement.rank}/{placement.size}] ending this rank: "
                     f"{reason}\n")
    sys.stderr.flush()
    os._exit(1)


def release_mpi_segments(local_rank: int) -> None:
    """Removes the names of MPICH's shared-memory segments, once every rank of
    this machine has mapped them (after a collective over the job), as the
    shm engine does with its own: MPICH removes them only in MPI_Finalize, so
    a rank killed or ended by the watch would leave them behind (under
    mpiexec, kdrun cleans up after the job). One rank of the machine does it."""
    if local_rank != 0:
        return
    for name in procfs.mapped_files(os.getpid(), "/dev/shm/"):
        if name.startswith(procfs.MPICH_SEGMENT_PREFIXES):
            try:
                os.unlink(f"/dev/shm/{name}")
            except OSError:
                pass


def _mpi_finalized() -> bool:
    module = sys.modules.get("mpi4py.MPI")
    try:
        return module is not None and bool(module.Is_finalized())
    except Exception:  # noqa: BLE001 - an MPI on its way down answers nothing useful
        return True


def check_world(placement: Placement, world_size: int, library: str) -> None:
    """MPI must have formed the job the rendezvous met (an MPI that does not
    speak PMI-1 through ``PMI_FD``, such as Open MPI, starts alone instead).

    Raises:
        RendezvousError: MPI's world is not the job's.
    """
    if world_size == placement.size:
        return
    name = library.strip().splitlines()[0] if library.strip() else "this MPI"
    raise RendezvousError(
        f"rank {placement.rank}: the rendezvous formed a job of {placement.size} processes, "
        f"but MPI started a world of {world_size} ({name}): processes that start "
        "themselves need an MPI of MPICH's family (pip install mpich), which forms its "
        "world through the rendezvous.")


def check_local_rank(placement: Placement | None, local_rank: int) -> None:
    """The cluster's ``LOCAL_RANK`` must be the one MPI found from the hosts.

    Raises:
        RendezvousError: they differ (the processes of one machine were
            numbered otherwise than in rank order).
    """
    if placement is None or placement.local_rank is None or placement.local_rank == local_rank:
        return
    raise RendezvousError(
        f"rank {placement.rank}: {placement.source} give LOCAL_RANK={placement.local_rank}, "
        f"but it is local rank {local_rank} among the ranks MPI finds on this machine "
        "(ordered by rank): number the processes of each machine 0, 1, ... in rank order.")
