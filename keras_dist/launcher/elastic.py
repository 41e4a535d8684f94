"""kdrun's elastic mode: launch the job again after a failure, resize it with the hosts.

MPI cannot shrink or grow a running job, so every change of size is a new
launch of the whole job (``cli.launch_once``, handed in by kdrun); the ranks
resume from the newest commit that any machine holds (``keras_dist.elastic``).
Every launch gets ``KERAS_DIST_ELASTIC_JOB`` (the same for the whole job)
and ``KERAS_DIST_ELASTIC_ROUND`` (how many launches came before).

- **A failure** (a rank failed, the job did not finish): launch again, at
  most ``--max-restarts`` times, on the slots that remain: a remote host
  silent for ``SILENCE_SECONDS`` (no supervisor heartbeat), or whose ranks
  all vanished without a word and that cannot be reached (``mpiexec -n 1
  true`` on it fails within ``PROBE_SECONDS``), is left out for
  ``--host-cooldown`` seconds. Without hosts, the job runs on this machine
  at ``-np`` ranks every time. With fewer than ``--min-np`` slots, kdrun
  waits up to ``--elastic-timeout`` seconds for the discovery script to offer
  more, then gives up.
- **A change of hosts** (``--host-discovery-script``, run every
  ``DISCOVERY_SECONDS``, or a fixed host back from its cooldown): kdrun
  writes ``hosts-updated <n>`` to the job's standard input; mpiexec forwards
  it to rank 0's supervisor, which passes it to the rank; at the next commit
  every rank raises ``HostsUpdatedInterrupt``, saves its state and ends
  cleanly (a ``resize`` record), and kdrun launches at the new size. Nothing
  is restored, nothing is lost, no restart is counted.

Each launch is reported: why, on how many ranks, which restart; once the
ranks report training again, what the restart cost (from the failure to
training again, split into stopping the job, starting the ranks, restoring).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import subprocess
import sys
import time

from keras_dist._runtime.statedir import job_root
from keras_dist.launcher import report
from keras_dist.launcher.hosts import format_hosts, parse_host_list, total_slots
from keras_dist.launcher.mpiexec import find_mpiexec, mpi_flavor
from keras_dist.launcher.options import LaunchOptions

ELASTIC_JOB_ENV = "KERAS_DIST_ELASTIC_JOB"
ELASTIC_ROUND_ENV = "KERAS_DIST_ELASTIC_ROUND"
#: How often the discovery script runs while the job does.
DISCOVERY_SECONDS = 1.0
#: Longest the discovery script may take.
DISCOVERY_TIMEOUT_SECONDS = 10.0
#: A remote host none of whose supervisors sent a record (each sends one a
#: second) for this long is lost.
SILENCE_SECONDS = 10.0
#: The same before the host's first record (its processes may be starting).
STARTUP_SILENCE_SECONDS = 60.0
#: How long a host may take to answer ``mpiexec -n 1 true``.
PROBE_SECONDS = 5.0
_LOCAL = ("localhost", "127.0.0.1", "::1")


def _say(message: str) -> None:
    sys.stderr.write(f"kdrun: elastic: {message}\n")
    sys.stderr.flush()


class Discovery:
    """The usable hosts: the discovery script's, or the fixed ones, minus those cooling down."""

    def __init__(self, options: LaunchOptions) -> None:
        self.elastic = options.elastic
        self.fixed = tuple(options.hosts)
        self.local = not options.hosts and not self.elastic.discovery_script
        self.size = options.num_proc
        self.excluded: dict[str, float] = {}
        self.last: tuple[tuple[str, int], ...] | None = None

    def hosts(self) -> tuple[tuple[str, int], ...]:
        """The usable hosts now, in order, with their slots."""
        if self.local:  # this machine: the slots asked for
            return (("localhost", self.size),)
        found = self._discover() if self.elastic.discovery_script else self.fixed
        now = time.monotonic()
        return tuple((host, slots) for host, slots in found
                     if self.excluded.get(host, 0.0) <= now)

    def _discover(self) -> tuple[tuple[str, int], ...]:
        script = self.elastic.discovery_script
        try:
            done = subprocess.run([script], capture_output=True, text=True,
                                  timeout=DISCOVERY_TIMEOUT_SECONDS, check=False)
        except (OSError, subprocess.TimeoutExpired) as error:
            _say(f"the host discovery script {script} failed ({error}); keeping the last hosts")
            return self.last or ()
        if done.returncode != 0:
            _say(f"the host discovery script {script} exited with status {done.returncode}; "
                 "keeping the last hosts")
            return self.last or ()
        items = [line.strip() for line in done.stdout.splitlines() if line.strip()]
        try:
            found = parse_host_list(",".join(
                item if ":" in item else f"{item}:{self.elastic.slots}" for item in items)) if (
                items) else ()
        except ValueError as error:
            _say(f"the host discovery script {script} printed something unusable ({error}); "
                 "keeping the last hosts")
            return self.last or ()
        self.last = tuple(found)
        return self.last

    def exclude(self, host: str) -> None:
        self.excluded[host] = time.monotonic() + self.elastic.cooldown


def placement(hosts, num_proc: int) -> dict[int, str]:
    """``{rank: host}`` as mpiexec places ranks: each host's slots in turn."""
    ranks: dict[int, str] = {}
    for host, slots in hosts:
        for _ in range(slots):
            if len(ranks) == num_proc:
                return ranks
            ranks[len(ranks)] = host
    return ranks


def trim(hosts, num_proc: int) -> tuple[tuple[str, int], ...]:
    """The first ``num_proc`` slots of ``hosts``."""
    kept, left = [], num_proc
    for host, slots in hosts:
        if left <= 0:
            break
        kept.append((host, min(slots, left)))
        left -= slots
    return tuple(kept)


class Watch:
    """Watches one launch: tells rank 0 when the discovered hosts change, and
    stops the launch when a remote host has been silent for ``SILENCE_SECONDS``
    (no record, not even a supervisor's heartbeat: the host or its network is
    gone, and MPI would wait on it for as long as TCP does)."""

    def __init__(self, discovery: Discovery, running, num_proc: int) -> None:
        self.discovery = discovery
        self.running = tuple(running)
        self.num_proc = num_proc
        self.next_check = time.monotonic() + DISCOVERY_SECONDS
        self.sent = 0
        self.change: str | None = None
        self.started = time.monotonic()
        self.seen: dict[int, float] = {}
        self.where = placement(running, num_proc)
        self.silent: list[str] = []

    def record(self, record: dict) -> None:
        if isinstance(record.get("rank"), int):
            self.seen[record["rank"]] = time.monotonic()

    def tick(self, proc) -> str | None:
        now = time.monotonic()
        if not self.discovery.local:
            for host, _ in self.running:
                ranks = [rank for rank, on in self.where.items() if on == host]
                heard = [self.seen[rank] for rank in ranks if rank in self.seen]
                # Before its first word a host may still be starting its processes.
                last, limit = (max(heard), SILENCE_SECONDS) if heard else (
                    self.started, STARTUP_SILENCE_SECONDS)
                if host not in _LOCAL and ranks and now - last > limit:
                    self.silent = [host]
                    return (f"no word from host {host} (ranks {ranks[0]}-{ranks[-1]}) for "
                            f"{limit:g} s: lost")
        self._check_hosts(proc)
        return None

    def _check_hosts(self, proc) -> None:
        # Hosts change with the discovery script, or when a fixed host left out
        # after a failure has served its cooldown.
        if not (self.discovery.elastic.discovery_script or self.discovery.excluded) or (
                time.monotonic() < self.next_check):
            return
        self.next_check = time.monotonic() + DISCOVERY_SECONDS
        hosts = self.discovery.hosts()
        names = {host for host, _ in hosts}
        gone = [host for host, _ in self.running if host not in names]
        slots = min(total_slots(hosts), self.discovery.elastic.max_np)
        change = None
        if gone:
            change = f"host{'s' if len(gone) > 1 else ''} {', '.join(gone)} removed"
        elif slots < self.num_proc:
            change = f"only {slots} slot(s) offered ({format_hosts(hosts)})"
        elif slots > self.num_proc:
            change = f"{slots - self.num_proc} more slot(s) offered ({format_hosts(hosts)})"
        if change is None or change == self.change:
            return
        self.change = change
        self.sent += 1
        try:
            proc.stdin.write(b"hosts-updated %d\n" % self.sent)
            proc.stdin.flush()
        except (OSError, ValueError):
            return
        _say(f"{change}: the job resizes at its next commit")


def _probe(host: str, options: LaunchOptions) -> bool:
    """Whether mpiexec can still start a process on ``host``."""
    mpiexec = options.mpiexec or find_mpiexec()
    try:
        done = subprocess.run([mpiexec, "-hosts", host, "-n", "1", "true"],
                              capture_output=True, timeout=PROBE_SECONDS, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def lost_hosts(outcome, hosts, num_proc: int, options: LaunchOptions) -> list[str]:
    """Hosts of the last launch that look dead: none of their ranks sent an exit
    record, and the host does not answer a probe."""
    where = placement(hosts, num_proc)
    silent = []
    for host, _ in hosts:
        ranks = [rank for rank, on in where.items() if on == host]
        if host in _LOCAL or not ranks:
            continue
        if all(outcome.reports.get(rank) is None or outcome.reports[rank].exit is None
               for rank in ranks):
            silent.append(host)
    return [host for host in silent if not _probe(host, options)]


def _wait_for_slots(discovery: Discovery, least: int, timeout: float):
    """The usable hosts once they hold ``least`` slots; None after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    said = False
    while True:
        hosts = discovery.hosts()
        if total_slots(hosts) >= least:
            return hosts
        if time.monotonic() >= deadline:
            return None
        if not said:
            _say(f"{total_slots(hosts)} slot(s) usable, fewer than --min-np {least}; waiting up "
                 f"to {timeout:g} s for more")
            said = True
        time.sleep(min(DISCOVERY_SECONDS, max(0.0, deadline - time.monotonic())))


def run(options: LaunchOptions, launch_once) -> int:
    """Runs an elastic job to its end; returns kdrun's exit code.

    Args:
        options: the job.
        launch_once: ``cli.launch_once``, which runs one launch of it.
    """
    job = secrets.token_hex(8)
    discovery = Discovery(options)
    used: set[str] = set()
    try:
        return _run(options, job, discovery, used, launch_once)
    except KeyboardInterrupt:  # between two launches (each handles its own signals)
        _say("interrupted; stopping")
        return 130
    finally:
        lost = sorted(used & set(discovery.excluded))
        _remove_state(options, job, used - set(lost))
        if lost:
            _say(f"the job's state may remain in {job_root(job)} (or under "
                 f"KERAS_DIST_ELASTIC_DIR) on the lost host(s) {', '.join(lost)}")


def _run(options: LaunchOptions, job: str, discovery: Discovery, used: set[str],
         launch_once) -> int:
    elastic = options.elastic
    restarts = resizes = launches = 0
    failed_at: float | None = None  # wall time of the failure being recovered from
    ended_at: float | None = None
    while True:
        hosts = _wait_for_slots(discovery, elastic.min_np, elastic.timeout)
        if hosts is None:
            _say(f"fewer than --min-np {elastic.min_np} slots usable after "
                 f"{elastic.timeout:g} s; giving up")
            return 1
        target = options.num_proc if launches == 0 else elastic.max_np
        num_proc = min(target, total_slots(hosts))
        hosts = trim(hosts, num_proc)
        used.update(host for host, _ in hosts)
        launch = dataclasses.replace(
            options, num_proc=num_proc, hosts=() if discovery.local else hosts,
            elastic=None)
        if launches:
            _say(f"launch {launches + 1} on {num_proc} rank(s)"
                 + ("" if discovery.local else f" ({format_hosts(hosts)})")
                 + f"; restarts so far {restarts} of {elastic.max_restarts}")
        watch = Watch(discovery, hosts, num_proc)
        started = time.monotonic()
        outcome = launch_once(launch, {
            ELASTIC_JOB_ENV: job, ELASTIC_ROUND_ENV: str(launches)}, watch,
            append_output=launches > 0)
        launches += 1
        _report_cost(outcome, failed_at, ended_at, started)
        failed_at = ended_at = None
        if outcome.signal is not None:
            return outcome.status
        if outcome.status == 0 and any(r.resize for r in outcome.reports.values()):
            resizes += 1
            _say(f"resizing ({watch.change or 'hosts changed'}); the state was saved "
                 "at the last commit")
            continue
        if outcome.status == 0:
            if restarts or resizes:
                _say(f"done after {launches} launches: {restarts} restart(s) after "
                     f"failures, {resizes} resize(s)")
            return 0
        failed_at = report.failure_wall(outcome.reports)
        ended_at = outcome.ended
        lost = [] if discovery.local else watch.silent or lost_hosts(
            outcome, hosts, num_proc, options)
        for host in lost:
            discovery.exclude(host)
        first = report.first_failed_rank(outcome.reports)
        what = (f"host{'s' if len(lost) > 1 else ''} {', '.join(lost)} lost" if lost
                else f"rank {first} failed" if first is not None else "the job failed")
        if restarts >= elastic.max_restarts:
            _say(f"{what}; no restart left (--max-restarts {elastic.max_restarts}); "
                 "giving up")
            return outcome.status or 1
        restarts += 1
        _say(f"{what}; restarting (restart {restarts} of {elastic.max_restarts})"
             + (f"; {', '.join(lost)} left out for {elastic.cooldown:g} s" if lost else ""))


def _report_cost(outcome, failed_at, ended_at, started) -> None:
    """After a relaunch: from the failure to training again, and its parts."""
    resumed = next((r.resumed for r in outcome.reports.values() if r.resumed), None)
    if resumed is None or failed_at is None or ended_at is None or not resumed.get("wall"):
        return
    to_wall = time.time() - time.monotonic()
    stopped, relaunched = ended_at + to_wall, started + to_wall
    restored = float(resumed.get("seconds") or 0.0)
    origin = (f"commit {resumed['commit']} (epoch {resumed.get('epoch')}, batch "
              f"{resumed.get('batch')})" if "commit" in resumed else "the start (no commit)")
    _say(f"training again {resumed['wall'] - failed_at:.1f} s after the failure, on "
         f"{resumed.get('size')} rank(s), from {origin}: the job stopped in "
         f"{stopped - failed_at:.1f} s, was relaunched {relaunched - stopped:.1f} s later, "
         f"its ranks started in {resumed['wall'] - relaunched - restored:.1f} s and "
         f"restored the state in {restored:.2f} s")


def _remove_state(options: LaunchOptions, job: str, hosts=()) -> None:
    """Removes the job's committed state, on this machine and on ``hosts``
    (every remote host the job ran on). The ranks remove theirs when training
    ends; this covers a job that failed for good, and hosts that were left out.
    """
    base = os.environ.get("KERAS_DIST_ELASTIC_DIR") or None
    root = job_root(job, base)
    shutil.rmtree(root, ignore_errors=True)
    remote = sorted({host for host in hosts if host not in _LOCAL})
    command = cleanup_command(options, remote, root)
    if command:
        try:
            subprocess.run(command, capture_output=True, timeout=PROBE_SECONDS * 2,
                           check=False)
        except (OSError, subprocess.TimeoutExpired):
            _say(f"could not remove the job's state ({root}) on "
                 f"{', '.join(remote)}; remove it by hand")


def cleanup_command(options: LaunchOptions, hosts: list[str], root: str) -> list[str] | None:
    """The mpiexec command removing ``root`` on each of ``hosts`` (one process
    each), or None without remote hosts or with an MPI other than MPICH's."""
    mpiexec = options.mpiexec or find_mpiexec()
    if not hosts or mpiexec is None or mpi_flavor(mpiexec) != "mpich":
        return None
    return [mpiexec, "-hosts", ",".join(hosts), "-ppn", "1", "-n", str(len(hosts)),
            sys.executable, "-c", f"import shutil; shutil.rmtree({root!r}, True)"]
