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

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import unquote

from keras_dist._runtime import procfs
from keras_dist._runtime.placement import Placement
from keras_dist.errors import RendezvousError

_SERVER = str(Path(__file__).with_name("pmi_server.py"))
#: Seconds between attempts to reach a rendezvous that is not listening yet
#: (rank 0 may start after the others: pods, actors and tasks start in any order).
_RETRY_SECONDS = (0.05, 1.0)

_joined: Placement | None = None


def joined() -> Placement | None:
    """The placement this process's MPI job was formed with, or None."""
    return _joined


def _start_server(placement: Placement, timeout: float) -> None:
    """Rank 0: listens on the rendezvous port and starts the process manager there."""
    try:
        listener = socket.create_server(("", placement.port), backlog=max(64, placement.size))
    except OSError as error:
        raise RendezvousError(
            f"rank 0 cannot listen on port {placement.port} for the rendezvous "
            f"{placement.address} ({placement.source}): {error}") from None
    with listener:
        subprocess.Popen(
            [sys.executable, _SERVER, "--fd", str(listener.fileno()),
             "--size", str(placement.size), "--timeout", str(timeout)],
            pass_fds=(listener.fileno(),), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, close_fds=True)


def _connect(host: str, port: int, deadline: float, placement: Placement,
             timeout: float) -> socket.socket:
    pause, last = _RETRY_SECONDS[0], None
    while True:
        try:
            sock = socket.create_connection((host, port),
                                            timeout=max(0.1, deadline - time.monotonic()))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as error:
            last = error
        if time.monotonic() + pause > deadline:
            raise RendezvousError(
                f"rank {placement.rank} of {placement.size} could not reach the rendezvous at "
                f"{placement.address} ({placement.source}) within {timeout:g} s "
                f"(KERAS_DIST_RENDEZVOUS_TIMEOUT): {last}. Rank 0 listens there from its "
                "kd.init() on.")
        time.sleep(pause)
        pause = min(pause * 2, _RETRY_SECONDS[1])


def _read_line(sock: socket.socket, buffer: bytearray) -> str | None:
    while b"\n" not in buffer:
        data = sock.recv(4096)
        if not data:
            return None
        buffer += data
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return line.decode(errors="replace")


def _fields(line: str) -> dict[str, str]:
    return dict(token.split("=", 1) for token in line.split(" ") if "=" in token)


def _greet(sock: socket.socket, placement: Placement, deadline: float, timeout: float) -> None:
    """Says who this rank is and waits until every rank has come."""
    host = socket.gethostname()
    sock.sendall(f"cmd=kd_hello rank={placement.rank} size={placement.size} host={host} "
                 f"pid={os.getpid()}\n".encode())
    # The server gives up at the timeout and says which ranks are missing:
    # wait a little longer, to hear that rather than guess.
    sock.settimeout(max(0.1, deadline + 5.0 - time.monotonic()))
    try:
        line = _read_line(sock, bytearray())
    except TimeoutError:
        line = ""
    sock.settimeout(None)
    fields = _fields(line or "")
    if fields.get("cmd") == "kd_ready":
        return
    if fields.get("cmd") == "kd_refuse":
        raise RendezvousError(f"the rendezvous at {placement.address} ({placement.source}) "
                              f"refused to start the job: {unquote(fields.get('message', ''))}")
    what = ("closed the connection" if line is None
            else f"did not start the job within {timeout:g} s")
    raise RendezvousError(
        f"rank {placement.rank} of {placement.size}: the rendezvous at {placement.address} "
        f"({placement.source}) {what} (KERAS_DIST_RENDEZVOUS_TIMEOUT); its rank 0 may have "
        "ended.")


def join(placement: Placement, timeout: float) -> None:
    """Meets the other ranks; MPI, initialised next, forms the job with them.

    Must run before ``mpi4py.MPI`` is imported in this process.

    Raises:
        RendezvousError: the rendezvous cannot be reached, refuses this
            process (another world size, a rank taken twice), or not every
            rank came within ``timeout`` seconds; the message names what was
            waited for.
    """
    global _joined
    deadline = time.monotonic() + timeout
    if placement.rank == 0:
        _start_server(placement, timeout)
        host = "127.0.0.1"
    else:
        host = placement.host
    sock = _connect(host, placement.port, deadline, placement, timeout)
    try:
        _greet(sock, placement, deadline, timeout)
    except BaseException:
        sock.close()
        raise
    # MPICH's PMI client takes the connection over, as it takes Hydra's.
    os.environ.update(PMI_FD=str(sock.detach()), PMI_RANK=str(placement.rank),
                      PMI_SIZE=str(placement.size))
    _joined = placement
    threading.Thread(target=_watch, args=(host, placement), name="keras_dist-rendezvous-watch",
                     daemon=True).start()


def mpi_started() -> None:
    """Once MPI is up: processes this one starts are not part of the job."""
    for name in ("PMI_FD", "PMI_RANK", "PMI_SIZE"):
        os.environ.pop(name, None)


def watch(host: str, port: int, rank: int = -1, timeout: float = 30.0) -> socket.socket:
    """A connection on which the job's process manager at ``host:port`` will
    say which rank failed first (``wait_for_failure``). ``rank``: the watching
    rank, or -1 for a watcher that is not one (an executor that outlives the
    ranks, to name the failed one).

    Raises:
        OSError: the process manager cannot be reached.
    """
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        sock.sendall(f"cmd=kd_watch rank={rank}\n".encode())
        # Watching from the answer on: a failure after it is told here.
        answer = b""
        while not answer.endswith(b"\n"):
            byte = sock.recv(1)
            if not byte:
                raise ConnectionError(f"the process manager at {host}:{port} closed the watch")
            answer += byte
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return sock


def wait_for_failure(sock: socket.socket) -> tuple[int | None, str] | None:
    """Blocks until the job ends: ``(rank, what happened)`` when the process
    manager names the rank that failed first, None when it ended without a
    word (the job finished, or the manager died with rank 0)."""
    try:
        line = _read_line(sock, bytearray())
    except OSError:
        return None
    fields = _fields(line or "")
    if fields.get("cmd") != "kd_abort":
        return None
    rank = fields.get("rank", "")
    return (int(rank) if rank.isdigit() else None), unquote(fields.get("message", ""))


def _watch(host: str, placement: Placement) -> None:
    """Ends this rank when the server says another rank died or aborted."""
    try:
        failure = wait_for_failure(watch(host, placement.port, placement.rank))
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
        if name.startswith(("mpich_shm_", "mpich_shar_tmp")):
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
