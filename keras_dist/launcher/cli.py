"""``kdrun``: runs a command on N ranks through ``mpiexec``.

    kdrun -np 4 python train.py --epochs 3
    kdrun -np 4 -H node1:2,node2:2 --timeline /tmp/tl.json -- python train.py

The mpiexec used is the one installed beside the running Python (``pip
install mpich`` puts it there), else the first on ``PATH``. Open MPI and
MPICH's hydra are both handled.

Every rank gets ``KERAS_DIST_JOB_ID`` (random, unique to the job),
``KERAS_DIST_STATUS_DIR`` (a private directory through which ranks report how
they ended, see ``keras_dist._runtime.jobstatus``) and ``KERAS_DIST_TIMELINE`` when
``--timeline`` is given. When the job fails, kdrun names the rank that raised
or died. Whatever happened, it leaves no process of the job running and
removes the shared-memory files the job left in ``/dev/shm``.

Failures kdrun handles beyond what mpiexec does: a rank that leaves with
status 0 without finishing (hydra reports success), a rank that exits before
MPI start-up while its peers wait for it there (hydra waits forever), and
kdrun's own death (mpiexec is SIGKILLed with it). SIGINT/SIGTERM/SIGHUP are
forwarded to mpiexec; ranks still running ``STOP_GRACE_SECONDS`` later, or at
a second signal, are SIGKILLed. Exit status: mpiexec's, 128 + the signal when
kdrun was signalled, 1 when kdrun found a failure mpiexec did not report.

mpiexec's own settings still apply through its environment, e.g. hydra's
``HYDRA_LAUNCHER`` / ``HYDRA_LAUNCHER_EXEC`` / ``HYDRA_IFACE`` to reach hosts
without ssh (tests/faults/test_multihost.py runs hosts that are network
namespaces this way).

This process never imports mpi4py: an MPI-initialised launcher would itself
leave MPICH's shared-memory segment behind.
"""

from __future__ import annotations

import functools
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from keras_dist._runtime import jobstatus as _jobstatus
from keras_dist._runtime import procfs
from keras_dist.launcher.cleanup import (
    JOB_ID_ENV,
    cleanup_shm,
    find_job_processes,
    kill_job_processes,
    shm_snapshot,
)
from keras_dist.launcher.mpiexec import build_command, find_mpiexec, mpi_flavor
from keras_dist.launcher.options import USAGE, LaunchOptions, UsageError, parse_args

TIMELINE_ENV = "KERAS_DIST_TIMELINE"
# Seconds the ranks get to stop after a forwarded SIGINT/SIGTERM/SIGHUP, and after
# mpiexec itself has ended, before kdrun kills what is left.
STOP_GRACE_SECONDS = 3.0
_POLL_SECONDS = 0.05
# Seconds ranks may stay in MPI start-up after a peer exited before init()
# (hydra never stops such a job) before kdrun stops it.
INIT_GRACE_SECONDS = 5.0


# --- watching ranks ------------------------------------------------------------


_RANK_ENV = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


class _RankWatcher:
    """Follows the job's local rank processes and the order in which they exit.

    Rank processes are found two ways: by their start files, and by a scan of
    /proc for processes carrying the job id and an MPI rank variable (so that
    ranks are seen before, or without, ``keras_dist.init()``). Exits are
    observed through pidfds, as they happen: the first rank to exit without
    finishing is the one that died, since hydra kills the others only after
    it noticed.
    """

    _SCAN_SECONDS = 0.5

    def __init__(self, status_dir: str, job_id: str, num_proc: int, all_local: bool) -> None:
        self._status_dir = status_dir
        self._num_proc = num_proc
        self._all_local = all_local
        self._missing_since: float | None = None
        self._job_id = job_id.encode()
        self._host = socket.gethostname()
        self._fds: dict[int, tuple[int, int]] = {}  # pidfd -> (rank, pid)
        self._watched: set[int] = set()  # pids
        self._next_scan = 0.0
        self.statuses: dict[int, _jobstatus.RankStatus] = {}
        #: Ranks in the order their processes exited while no rank had reported an
        #: error other than PeerFailureError.
        self.exit_order: list[int] = []
        #: Ranks that may each have been the first to exit: seen in the same
        #: wake-up with nothing to tell their order (empty when it was clear).
        self.first_tied: list[int] = []
        #: rank -> (pid, monotonic time) of rank processes that exited before init().
        self.exited_before_init: dict[int, tuple[int, float]] = {}
        #: rank -> pid of rank processes alive now.
        self.alive: dict[int, int] = {}

    def poll(self, timeout: float) -> None:
        self._scan()
        if not self._fds:
            time.sleep(timeout)
            return
        try:
            ready, _, _ = select.select(list(self._fds), [], [], timeout)
        except (OSError, ValueError):
            return
        # Exits seen together (kdrun was not scheduled in between): see _exit_rank.
        # Among equals, a rank that reported seeing a peer fail went after it.
        self._read_status()

        def order(fd):
            rank, pid = self._fds[fd]
            status = self.statuses.get(rank)
            return _exit_rank(pid), status is not None and status.is_peer_failure

        keys = {fd: order(fd) for fd in ready}
        ranked = sorted(ready, key=keys.get)
        if not self.exit_order and ranked:
            tied = [self._fds[fd][0] for fd in ranked if keys[fd] == keys[ranked[0]]]
            self.first_tied = tied if len(tied) > 1 else []
        for fd in ranked:
            self._exited(fd)

    def close(self) -> None:
        # A final look: ranks that ended between the last poll and now.
        self._read_status()
        if self._fds:
            try:
                ready, _, _ = select.select(list(self._fds), [], [], 0)
            except (OSError, ValueError):
                ready = []
            for fd in ready:
                self._exited(fd)
        for fd in list(self._fds):
            os.close(fd)
        self._fds.clear()

    def stuck_in_init(self, grace: float) -> list[int]:
        """Ranks still starting MPI ``grace`` s after a peer left before init().

        Such ranks wait for the missing peer forever: hydra does not stop a job
        whose rank exits before it has initialised MPI. A peer has left when
        its process was seen to exit, or (all ranks on this machine) when it
        is not running at all.
        """
        missing = set(self.exited_before_init)
        if self._all_local:
            missing |= set(range(self._num_proc)) - self.alive.keys()
        if not missing or not self.alive or self.statuses.keys() & self.alive.keys():
            self._missing_since = None
            return []
        now = time.monotonic()
        if self._missing_since is None:
            self._missing_since = now
        if now - self._missing_since < grace:
            return []
        return sorted(rank for rank, pid in self.alive.items()
                      if procfs.maps_contains(pid, "libmpi"))

    def _exited(self, fd: int) -> None:
        rank, pid = self._fds.pop(fd)
        os.close(fd)
        self._record_exit(rank, pid)

    def _record_exit(self, rank: int, pid: int) -> None:
        if self.alive.get(rank) == pid:
            del self.alive[rank]
        self._read_status()
        # A rank that saw a peer die (PeerFailureError) may report before the
        # peer's exit is seen here: only other errors end the exit order.
        no_error_yet = all(status.error is None or status.is_peer_failure
                           for status in self.statuses.values())
        if rank not in self.exit_order and no_error_yet:
            self.exit_order.append(rank)
        if rank not in self.statuses:
            self.exited_before_init.setdefault(rank, (pid, time.monotonic()))

    def _watch(self, rank: int, pid: int) -> None:
        if pid in self._watched or not hasattr(os, "pidfd_open"):
            return
        self._watched.add(pid)
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            self._record_exit(rank, pid)
            return
        self._fds[fd] = (rank, pid)
        self.alive[rank] = pid

    def _read_status(self) -> None:
        self.statuses = _jobstatus.read_status(self._status_dir)

    def _scan(self) -> None:
        self._read_status()
        for rank, status in self.statuses.items():
            if status.pid is not None and status.host == self._host:
                self._watch(rank, status.pid)
        now = time.monotonic()
        if now < self._next_scan or len(self.exit_order) + len(self.alive) >= self._num_proc:
            return
        self._next_scan = now + self._SCAN_SECONDS
        candidates = {}
        for pid in procfs.pids():
            environ = procfs.environ(pid)
            if environ.get(JOB_ID_ENV.encode()) != self._job_id:
                continue
            rank = next((environ[name.encode()] for name in _RANK_ENV
                         if name.encode() in environ), None)
            if rank is not None and rank.isdigit():
                candidates[pid] = int(rank)
        for pid, rank in candidates.items():
            # A rank's own children inherit its variables: watch the topmost.
            parent = procfs.parent_pid(pid)
            if candidates.get(parent) != rank:
                self._watch(rank, pid)


_HARD_SIGNALS = {signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE,
                 signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


def _exit_rank(pid: int) -> int:
    """Where an exit seen together with others goes in the exit order.

    0: already reaped; 1: a zombie killed by a hard signal; 2: a zombie that
    exited or aborted. hydra's proxy reaps a rank that died (it needs the
    exit status) before it has the others killed, so a reaped rank went
    first; a rank killed by a signal goes before one that exited or aborted
    because of it. Read from /proc/<pid>/stat (state, and exit_code in field
    52), which lasts until the parent reaps the zombie.
    """
    status = procfs.zombie_exit_status(pid)
    if status is None:
        return 0
    return 1 if (status & 0x7F) in _HARD_SIGNALS else 2


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def describe_failure(
    statuses: dict[int, _jobstatus.RankStatus], num_proc: int, exit_order: list[int],
    returncode: int, exited_before_init: dict[int, int] | None = None,
    first_tied: list[int] | None = None,
) -> list[str]:
    """kdrun's lines explaining a failed job, one per failed rank.

    Args:
        statuses: what the ranks reported (``_jobstatus.read_status``).
        num_proc: the job's number of ranks.
        exit_order: ranks in the order their processes were seen to exit
            while no rank had yet reported an exception other than
            PeerFailureError. The first of them
            that did not finish is the one that died: the others were
            stopped after it (by mpiexec, or by an error raised because of it).
        returncode: mpiexec's exit status.
        exited_before_init: ``{rank: pid}`` of rank processes seen to exit
            before they reported starting.
        first_tied: ranks whose exits were seen at once, first, with nothing
            to tell which came first: all are named, none blamed alone.
    """
    lines = []
    exited_before_init = exited_before_init or {}
    first = exit_order[0] if exit_order else None
    died_before_init = first is not None and first not in statuses and (
        first in exited_before_init)
    if died_before_init:
        lines.append(
            f"kdrun: rank {first} (pid {exited_before_init[first]}) ended before "
            "keras_dist.init() finished: killed by a signal or exited early"
        )
    if not statuses:
        if not lines:
            lines.append(
                f"kdrun: the job failed (mpiexec exit code {returncode}) and no rank reported "
                "its status: the command may have failed before keras_dist.init()."
            )
        return lines
    errors = [status for status in statuses.values() if status.error is not None]
    unfinished = [s for s in statuses.values() if s.started and not s.done and s.error is None]
    died = [] if died_before_init else [
        statuses[rank] for rank in exit_order if rank in statuses and statuses[rank] in unfinished
    ][:1]
    tied = [statuses[rank] for rank in first_tied or ()
            if rank in statuses and statuses[rank] in unfinished]
    if died and len(tied) > 1 and died[0] in tied:
        died = tied
        lines.append(
            f"kdrun: {' or '.join(s.describe() for s in tied)} ended without finishing: "
            "killed by a signal or exited early (their exits reached kdrun at once, so "
            "which came first is unknown)"
        )
    else:
        if not died and not errors and not died_before_init:
            # No exit was seen (ranks on other hosts): every unfinished rank is a suspect.
            died = unfinished
        for status in died:
            lines.append(
                f"kdrun: {status.describe()} ended without finishing: "
                "killed by a signal or exited early"
            )
    for status in errors:
        lines.append(f"kdrun: {status.describe()} raised an exception: {status.error_summary}")
    stopped = [s.rank for s in unfinished if s not in died]
    if stopped:
        lines.append(f"kdrun: {_ranks(stopped)} stopped when the job ended.")
    missing = [rank for rank in range(num_proc)
               if rank not in statuses and not (died_before_init and rank == first)]
    if missing:
        lines.append(f"kdrun: {_ranks(missing)} never reported starting "
                     "(failed or stopped before keras_dist.init()).")
    return lines


# --- the launcher --------------------------------------------------------------


def _say(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def launch(options: LaunchOptions) -> int:
    """Runs the job; returns kdrun's exit code."""
    mpiexec = options.mpiexec or find_mpiexec()
    if mpiexec is None:
        _say(f"kdrun: cannot find mpiexec (looked beside {sys.executable} and on PATH). "
             "Install an MPI, for example `pip install mpich`.")
        return 127
    flavor = mpi_flavor(mpiexec)
    if options.output_dir:
        os.makedirs(options.output_dir, exist_ok=True)
    job_id = secrets.token_hex(8)
    status_dir = tempfile.mkdtemp(prefix=f"kdrun-{job_id}-")
    os.chmod(status_dir, 0o700)
    job_env = {JOB_ID_ENV: job_id, _jobstatus.STATUS_DIR_ENV: status_dir}
    if options.timeline:
        job_env[TIMELINE_ENV] = options.timeline
    env = dict(os.environ, **job_env)
    if flavor.startswith("openmpi") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    shm_before = shm_snapshot()
    received: list[int] = []

    def on_signal(signum, frame):
        received.append(signum)

    previous = {sig: signal.signal(sig, on_signal)
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    local_names = {"localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()}
    all_local = all(host in local_names for host, _ in options.hosts)
    watcher = _RankWatcher(status_dir, job_id, options.num_proc, all_local)
    proc = None
    try:
        try:
            proc = subprocess.Popen(
                build_command(mpiexec, flavor, options, job_env), env=env,
                start_new_session=True, preexec_fn=functools.partial(_die_with_parent, os.getpid()),
            )
        except OSError as error:
            _say(f"kdrun: cannot start {mpiexec}: {error}")
            return 127
        _prefer_this_thread()
        returncode, stuck = _supervise(proc, watcher, received, job_id)
        watcher.close()
        if received:
            return 128 + received[0]
        if stuck:
            gone = sorted(set(range(options.num_proc)) - set(stuck))
            _say(f"kdrun: rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} "
                 f"exited before keras_dist.init() while rank{'s' if len(stuck) > 1 else ''} "
                 f"{', '.join(map(str, stuck))} waited for {'them' if len(gone) > 1 else 'it'} "
                 "to start MPI; stopped the job.")
            return 1
        statuses = _jobstatus.read_status(status_dir)
        if returncode == 0 and any(s.started and not s.done for s in statuses.values()):
            # hydra reports success when a rank leaves without MPI_Finalize
            # with status 0, even though it then SIGKILLs the others.
            _say("kdrun: mpiexec reported success, but not every rank finished:")
            returncode = 1
        if returncode > 128 and proc.returncode < 0:
            _say(f"kdrun: mpiexec was killed by {signal.Signals(-proc.returncode).name}.")
        elif returncode != 0:
            before_init = {rank: pid for rank, (pid, _) in watcher.exited_before_init.items()}
            for line in describe_failure(statuses, options.num_proc, watcher.exit_order,
                                         returncode, before_init, watcher.first_tied):
                _say(line)
        return returncode
    finally:
        watcher.close()
        if proc is not None and proc.poll() is None:
            _kill_group(proc)
        kill_job_processes(job_id)
        cleanup_shm(job_id, shm_before)
        shutil.rmtree(status_dir, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _prefer_this_thread() -> None:
    """Lets kdrun run ahead of the job's processes, where permitted.

    kdrun names the rank that died by the order in which rank processes exit:
    when the dead rank's exit and the kills that follow it reach kdrun in the
    same wake-up (kdrun was not scheduled in between), the order is lost. A
    higher priority for kdrun's own thread (set after mpiexec started, so no
    child inherits it; kdrun sleeps almost all the time) keeps the wake-ups apart.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -10)
    except (OSError, AttributeError):
        pass


def _die_with_parent(parent_pid: int) -> None:
    """In mpiexec, before exec: be SIGKILLed if kdrun itself dies.

    mpiexec runs in a session of its own, so nothing else would stop it (and
    the ranks) when kdrun is SIGKILLed; hydra's proxies stop the ranks when
    mpiexec goes.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # kdrun already gone
        os._exit(1)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _supervise(proc: subprocess.Popen, watcher: _RankWatcher, received: list[int],
               job_id: str) -> tuple[int, list[int]]:
    """Waits for mpiexec, forwarding signals.

    Returns:
        kdrun's exit code for the job so far, and the ranks found stuck in MPI
        start-up after a peer exited before init (then the job was stopped).
    """
    forwarded = 0
    kill_at = None
    stuck: list[int] = []
    while proc.poll() is None:
        if len(received) > forwarded:
            signum = received[forwarded]
            forwarded = len(received)
            if forwarded == 1:
                _say(f"kdrun: {signal.Signals(signum).name} received; stopping the job.")
                kill_at = time.monotonic() + STOP_GRACE_SECONDS
            else:
                kill_at = time.monotonic()  # asked twice: stop now
            try:
                proc.send_signal(signum)
            except OSError:
                pass
        if not stuck and kill_at is None:
            stuck = watcher.stuck_in_init(INIT_GRACE_SECONDS)
            if stuck:
                kill_at = time.monotonic()
        if kill_at is not None and time.monotonic() >= kill_at:
            _kill_group(proc)
            kill_job_processes(job_id)
            break
        watcher.poll(_POLL_SECONDS)
    returncode = proc.wait()
    # mpiexec is gone; give ranks it left behind (-disable-auto-cleanup, a
    # crashed hydra) a moment to end on their own, then kill them.
    deadline = time.monotonic() + (0 if received or stuck else STOP_GRACE_SECONDS)
    while find_job_processes(JOB_ID_ENV, job_id) and time.monotonic() < deadline:
        watcher.poll(_POLL_SECONDS)
    left = kill_job_processes(job_id)
    if left and not stuck:
        _say(f"kdrun: killed {left} process{'es' if left > 1 else ''} of the job that "
             "outlived mpiexec.")
        if returncode == 0:
            returncode = 1
    if returncode < 0:
        return 128 - returncode, stuck
    return returncode, stuck


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kdrun`` and ``python -m keras_dist.run``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        options = parse_args(argv)
    except UsageError as error:
        if str(error):
            _say(f"kdrun: {error}")
            sys.stderr.write(USAGE)
            return 2
        sys.stdout.write(USAGE)
        return 0
    return launch(options)


if __name__ == "__main__":
    sys.exit(main())
