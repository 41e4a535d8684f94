"""``kdrun``: runs a command on N ranks through ``mpiexec``.

    kdrun -np 4 python train.py --epochs 3
    kdrun -np 4 -H node1:2,node2:2 --timeline /tmp/tl.json -- python train.py

The mpiexec used is the one installed beside the running Python (``pip
install mpich`` puts it there), else the first on ``PATH``. Open MPI and
MPICH's hydra are both handled.

mpiexec starts a supervisor per rank (``keras_dist.launcher.supervisor``),
which runs the command and sends back, through the output mpiexec forwards
from every host, the rank's output a line at a time and records of what
happened to it. kdrun prints each line whole with its rank, ``[1] text``
(``--no-label``, ``--ranks``, ``--output-dir`` change that), and when the job
fails names the rank that failed first, from those records alone
(``keras_dist.launcher.report``). Every rank gets ``KERAS_DIST_JOB_ID``
(random, unique to the job) and ``KERAS_DIST_TIMELINE`` when ``--timeline`` is
given. Whatever happened, kdrun leaves no process of the job running and
removes the shared-memory files the job left in ``/dev/shm``.

Failures kdrun handles beyond what mpiexec does: a rank that failed while
mpiexec keeps the job running (hydra stops only that rank's host, and waits
forever when a rank fails before MPI start-up while its peers wait for it
there): kdrun stops the job ``STOP_GRACE_SECONDS`` later; and kdrun's own
death (mpiexec is SIGKILLed with it). SIGINT/SIGTERM/SIGHUP are forwarded to mpiexec; ranks
still running ``STOP_GRACE_SECONDS`` later, or at a second signal, are
SIGKILLed. Exit status: that of the rank that failed first (its status, or
128 + the signal that killed it), else mpiexec's; 128 + the signal when kdrun
was signalled; 1 when kdrun found a failure mpiexec did not report.

mpiexec's own settings still apply through its environment, e.g. hydra's
``HYDRA_LAUNCHER`` / ``HYDRA_LAUNCHER_EXEC`` / ``HYDRA_IFACE`` to reach hosts
without ssh (tests/faults/test_multihost.py runs hosts that are network
namespaces this way).

This process never imports mpi4py: an MPI-initialised launcher would itself
leave MPICH's shared-memory segment behind.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import selectors
import signal
import subprocess
import sys
import time

from keras_dist.launcher import report, supervisor
from keras_dist.launcher.cleanup import (
    JOB_ID_ENV,
    cleanup_shm,
    find_job_processes,
    kill_job_processes,
    shm_snapshot,
)
from keras_dist.launcher.mpiexec import build_command, find_mpiexec, mpi_flavor
from keras_dist.launcher.options import USAGE, LaunchOptions, UsageError, parse_args
from keras_dist.launcher.output import OutputRouter

TIMELINE_ENV = "KERAS_DIST_TIMELINE"
# Seconds the ranks get to stop after a forwarded SIGINT/SIGTERM/SIGHUP, and after
# mpiexec itself has ended, before kdrun kills what is left.
STOP_GRACE_SECONDS = 3.0
_POLL_SECONDS = 0.05


def _say(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def supervised_command(command: tuple[str, ...]) -> tuple[str, ...]:
    """``command`` run under the per-rank supervisor.

    The supervisor is run by path, not with ``-m``: importing the
    ``keras_dist`` package first would cost every rank a second of start-up.
    """
    return (sys.executable, supervisor.__file__, "--", *command)


@dataclasses.dataclass
class Outcome:
    """How one launch of a job ended."""

    #: kdrun's exit code for it.
    status: int
    #: What each rank's records said.
    reports: dict[int, report.RankReport]
    #: kdrun (not mpiexec) ended the job: a rank had failed.
    stopped: bool = False
    #: The signal kdrun received, if any.
    signal: int | None = None
    #: CLOCK_MONOTONIC when mpiexec had ended and the job's processes were gone.
    ended: float = 0.0


def launch(options: LaunchOptions) -> int:
    """Runs the job; returns kdrun's exit code."""
    if options.elastic is not None:
        from keras_dist.launcher import elastic

        return elastic.run(options, launch_once)
    return launch_once(options).status


def launch_once(options: LaunchOptions, job_env: dict[str, str] | None = None,
                watch=None, append_output: bool = False) -> Outcome:
    """Runs the job once.

    Args:
        options: the job.
        job_env: more variables for every rank.
        watch: an object whose ``record(record)`` gets every record, and whose
            ``tick(proc)`` is called about every 50 ms while mpiexec runs; a
            string it returns stops the job, saying why (elastic jobs; their
            ``proc.stdin`` is a pipe to write to).
        append_output: add to the files of ``--output-dir`` instead of
            replacing them (the later launches of an elastic job).
    """
    mpiexec = options.mpiexec or find_mpiexec()
    if mpiexec is None:
        _say(f"kdrun: cannot find mpiexec (looked beside {sys.executable} and on PATH). "
             "Install an MPI, for example `pip install mpich`.")
        return Outcome(127, {})
    flavor = mpi_flavor(mpiexec)
    if options.output_dir:
        os.makedirs(options.output_dir, exist_ok=True)
    job_id = secrets.token_hex(8)
    job_env = {JOB_ID_ENV: job_id, **(job_env or {})}
    # A rank that crashes in native code (a segfault or abort) prints its Python
    # stack before it dies, so its output says where; the user's own setting wins.
    if "PYTHONFAULTHANDLER" not in os.environ:
        job_env["PYTHONFAULTHANDLER"] = "1"
    if options.timeline:
        job_env[TIMELINE_ENV] = os.path.abspath(options.timeline)
    if options.gpu_per_rank:
        job_env[supervisor.GPU_PER_RANK_ENV] = "1"
    env = dict(os.environ, **job_env)
    if flavor.startswith("openmpi") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    # kdrun writes --output-dir itself, for every MPI flavour.
    job = dataclasses.replace(options, command=supervised_command(options.command),
                              output_dir=None)
    shm_before = shm_snapshot()
    received: list[int] = []

    def on_signal(signum, frame):
        received.append(signum)

    previous = {sig: signal.signal(sig, on_signal)
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    reports: dict[int, report.RankReport] = {}
    on_record = functools.partial(report.apply, reports)
    if watch is not None:
        def on_record(record, apply=on_record):
            apply(record)
            watch.record(record)
    router = OutputRouter(
        sys.stdout.buffer, sys.stderr.buffer, on_record,
        label=options.label, ranks=options.ranks, output_dir=options.output_dir,
        append=append_output,
    )
    proc = None
    try:
        try:
            proc = subprocess.Popen(
                build_command(mpiexec, flavor, job, job_env), env=env,
                stdin=subprocess.PIPE if watch is not None else None,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                preexec_fn=functools.partial(_die_with_parent, os.getpid()),
            )
        except OSError as error:
            _say(f"kdrun: cannot start {mpiexec}: {error}")
            return Outcome(127, reports)
        returncode, stopped = _supervise(proc, router, reports, received, job_id,
                                         options.num_proc, watch)
        router.close()
        if received:
            return Outcome(128 + received[0], reports, signal=received[0],
                           ended=time.monotonic())
        if stopped:
            _say(stopped)
            for line in report.describe_failure(reports, options.num_proc, returncode):
                _say(line)
            return Outcome(1, reports, stopped=True, ended=time.monotonic())
        if returncode == 0 and report.any_failure(reports):
            # A rank that left with status 0 without finishing, seen by its supervisor.
            _say("kdrun: mpiexec reported success, but a rank failed:")
            returncode = 1
        if returncode > 128 and proc.returncode < 0:
            _say(f"kdrun: mpiexec was killed by {signal.Signals(-proc.returncode).name}.")
        elif returncode != 0:
            for line in report.describe_failure(reports, options.num_proc, returncode):
                _say(line)
            # hydra's own status is that of whichever process it reaped first.
            returncode = report.exit_status(reports) or returncode
        return Outcome(returncode, reports, ended=time.monotonic())
    finally:
        if proc is not None and proc.poll() is None:
            _kill_group(proc)
        kill_job_processes(job_id)
        router.close()
        cleanup_shm(job_id, shm_before)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


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


def _supervise(proc: subprocess.Popen, router: OutputRouter,
               reports: dict[int, report.RankReport], received: list[int], job_id: str,
               num_proc: int, watch=None) -> tuple[int, str | None]:
    """Relays mpiexec's output and forwards signals until the job has ended.

    kdrun stops the job itself when the records show a rank failed and
    mpiexec has not ended the job ``STOP_GRACE_SECONDS`` later: hydra stops
    only the failed rank's host, and nothing when a rank fails before MPI
    start-up while its peers wait for it there.

    Returns:
        kdrun's exit code for the job so far, and the line saying why kdrun
        stopped the job itself (None when it did not).
    """
    selector = selectors.DefaultSelector()
    sources = {proc.stdout.fileno(): "o", proc.stderr.fileno(): "e"}
    for fd in sources:
        selector.register(fd, selectors.EVENT_READ)

    def relay(timeout: float) -> None:
        for key, _ in selector.select(timeout):
            data = os.read(key.fd, 65536)
            if data:
                router.feed(sources[key.fd], data)
            else:
                selector.unregister(key.fd)
                del sources[key.fd]

    forwarded = 0
    kill_at = None
    stopped = None
    failed_since = None
    while proc.poll() is None:
        now = time.monotonic()
        if len(received) > forwarded:
            signum = received[forwarded]
            forwarded = len(received)
            if forwarded == 1:
                _say(f"kdrun: {signal.Signals(signum).name} received; stopping the job.")
                kill_at = now + STOP_GRACE_SECONDS
            else:
                kill_at = now  # asked twice: stop now
            try:
                proc.send_signal(signum)
            except OSError:
                pass
        failed = report.first_failed_rank(reports)
        failed_since = (failed_since or now) if failed is not None else None
        if kill_at is None and failed is not None and now - failed_since >= STOP_GRACE_SECONDS:
            kill_at = now
            gone, waiting = report.stuck_in_startup(reports, num_proc)
            if gone:
                stopped = (f"kdrun: {_ranks(gone)} exited before keras_dist.init() while "
                           f"{_ranks(waiting)} waited for {'them' if len(gone) > 1 else 'it'} "
                           "to start MPI; stopped the job.")
            else:
                stopped = (f"kdrun: rank {failed} failed and mpiexec had not ended the job "
                           f"{STOP_GRACE_SECONDS:g} s later; stopped the job.")
        if kill_at is not None and now >= kill_at:
            _kill_group(proc)
            kill_job_processes(job_id)
            break
        if watch is not None:
            reason = watch.tick(proc)
            if reason and kill_at is None:
                kill_at, stopped = now, f"kdrun: {reason}; stopped the job."
        relay(_POLL_SECONDS)
    returncode = proc.wait()
    # mpiexec is gone; give ranks it left behind (-disable-auto-cleanup, a
    # crashed hydra) a moment to end on their own and their last output to
    # arrive, then kill them.
    deadline = time.monotonic() + (0 if received or stopped else STOP_GRACE_SECONDS)
    while (sources or find_job_processes(JOB_ID_ENV, job_id)) and time.monotonic() < deadline:
        relay(_POLL_SECONDS)
    left = kill_job_processes(job_id)
    if left and stopped is None:
        _say(f"kdrun: killed {left} process{'es' if left > 1 else ''} of the job that "
             "outlived mpiexec.")
        if returncode == 0:
            returncode = 1
    deadline = time.monotonic() + 1.0  # what the killed processes had written
    while sources and time.monotonic() < deadline:
        relay(_POLL_SECONDS)
    selector.close()
    if returncode < 0:
        return 128 - returncode, stopped
    return returncode, stopped


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
    status = launch(options)
    if options.timeline:
        _merge_timeline(os.path.abspath(options.timeline))
    return status


def _merge_timeline(path: str) -> None:
    """Joins the ranks' timeline parts into ``path`` (those on this machine)."""
    from keras_dist._runtime import timeline_parts

    ranks = timeline_parts.merge(path)
    if ranks:
        _say(f"kdrun: timeline of ranks {_ranges(ranks)} written to {path}")
    elif os.path.exists(path):  # a job of one rank writes its trace itself
        _say(f"kdrun: timeline written to {path}")
    else:
        _say(f"kdrun: no rank wrote a timeline part ({path}.rank<R>) on this machine")


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5``."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans)


if __name__ == "__main__":
    sys.exit(main())
