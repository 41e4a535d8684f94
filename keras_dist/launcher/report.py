"""What kdrun says about a job, decided from the ranks' records alone.

Each rank's supervisor (``keras_dist.launcher.supervisor``) sends records:
``started``, ``error`` (an unhandled exception, with the rank it blames when it
is the consequence of another's failure) and ``exit`` (how the child ended,
with the CLOCK_MONOTONIC and wall times the supervisor saw it). A rank whose
supervisor was killed by the process manager sends no exit record: it was
stopped by the launcher. Everything here is a pure function of those records.

The first failed rank is the one whose failure is not a consequence of
another's, earliest by monotonic time among failures on the same host, then
by wall time across hosts (clocks of different machines are only comparable
by wall time); ties go to the lower rank, so exactly one rank is named. One
exception: a crash (SIGSEGV and the like) seen less than
``CRASH_WINDOW_SECONDS`` before another rank's kill from outside (SIGKILL,
SIGTERM, ...) is taken for its consequence. A killed process's connections
reset before its supervisor learns of the death, and an MPI library can crash
on the reset and be seen first, on a loaded machine or on another host. When
every failure recorded is a consequence (the rank that died had no chance to
record anything), the rank they blame is the one named.

kdrun's exit status is that of the rank named: its status, or 128 plus the
signal that killed it (``exit_status``).
"""

from __future__ import annotations

import dataclasses
import signal as signals

#: Signals a process gets only from outside (a user, the OOM killer, a batch
#: system), never from a fault of its own or a peer's.
KILLED_FROM_OUTSIDE = frozenset({"SIGKILL", "SIGTERM", "SIGINT", "SIGHUP"})
#: Signals of a crash, which an MPI library can suffer when a dead peer's
#: connections reset.
CRASHES = frozenset({"SIGSEGV", "SIGBUS", "SIGABRT", "SIGFPE", "SIGILL"})
#: How long before a peer's kill from outside a crash is taken for its consequence.
CRASH_WINDOW_SECONDS = 1.0


@dataclasses.dataclass
class RankReport:
    """What one rank's records said so far."""

    rank: int
    host: str | None = None
    pid: int | None = None
    started: bool = False
    error: dict | None = None
    exit: dict | None = None
    #: The rank ended for a graceful resize of an elastic job.
    resize: bool = False
    #: The last "training again" record of an elastic job (its info, wall time).
    resumed: dict | None = None

    def where(self) -> str:
        """``"rank 1 (pid 1234 on host)"``, with what is known."""
        parts = ([f"pid {self.pid}"] if self.pid is not None else []) + (
            [f"on {self.host}"] if self.host else [])
        return f"rank {self.rank} ({' '.join(parts)})" if parts else f"rank {self.rank}"


@dataclasses.dataclass(frozen=True)
class Failure:
    """How one rank failed, and when."""

    rank: int
    host: str | None
    mono: float
    wall: float
    what: str
    #: The rank whose failure this one reports (PeerFailureError), else None.
    consequence_of: int | None = None
    #: The rank's supervisor was signalled (the launcher stopping the job).
    stopped: bool = False
    #: The signal that killed the rank's process ("SIGSEGV"), else None.
    signal: str | None = None


def apply(reports: dict[int, RankReport], record: dict) -> None:
    """Folds one record (as a supervisor sent it) into ``reports``; ignores malformed ones."""
    rank = record.get("rank")
    event = record.get("event")
    if not isinstance(rank, int) or rank < 0 or event not in (
            "started", "error", "exit", "resize", "resumed", "alive"):
        return
    report = reports.setdefault(rank, RankReport(rank))
    if isinstance(record.get("host"), str):
        report.host = record["host"]
    if isinstance(record.get("pid"), int):
        report.pid = record["pid"]
    if event == "started":
        report.started = True
    elif event == "resize":
        report.resize = True
    elif event == "resumed" and isinstance(record.get("info"), dict):
        report.resumed = dict(record["info"], wall=record.get("wall"))
    elif event == "error" and isinstance(record.get("error"), dict):
        report.error = record["error"]
    elif event == "exit":
        report.exit = record
        report.started = report.started or bool(record.get("started"))
        if isinstance(record.get("error"), dict):
            report.error = record["error"]


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] + (" [...]" if len(lines) > 1 else "") if lines else ""


def _error_text(error: dict) -> str:
    message = _first_line(str(error.get("message") or ""))
    return f"{error.get('type')}: {message}" if message else str(error.get("type"))


def _exit_text(exit_record: dict) -> str | None:
    """How the child ended when that is a failure, else None."""
    if exit_record.get("spawn_error"):
        return f"could not start: {exit_record['spawn_error']}"
    if exit_record.get("signal"):
        return f"killed by {exit_record['signal']}"
    code = exit_record.get("returncode")
    if code:
        started = "" if exit_record.get("started") else " before keras_dist.init()"
        return f"exited with status {code}{started}"
    if exit_record.get("started") and not exit_record.get("finished"):
        return "exited with status 0 without keras_dist.shutdown() (left the job early)"
    return None


def failure(report: RankReport) -> Failure | None:
    """How ``report``'s rank failed, or None when its records show no failure."""
    if report.error is not None:
        error = report.error
        peer = error.get("peer_rank")
        return Failure(
            report.rank, report.host, float(error.get("mono") or 0.0),
            float(error.get("wall") or 0.0), f"raised {_error_text(error)}",
            consequence_of=peer if isinstance(peer, int) and peer != report.rank else None,
        )
    if report.exit is None:
        return None
    what = _exit_text(report.exit)
    if what is None:
        return None
    return Failure(report.rank, report.host, float(report.exit.get("mono") or 0.0),
                   float(report.exit.get("wall") or 0.0), what,
                   stopped=bool(report.exit.get("stopped_by")),
                   signal=report.exit.get("signal") or None)


def earliest(failures: list[Failure]) -> Failure:
    """The earliest of ``failures``: by monotonic time per host, then by wall time."""
    per_host: dict[str | None, Failure] = {}
    for item in failures:
        best = per_host.get(item.host)
        if best is None or (item.mono, item.rank) < (best.mono, best.rank):
            per_host[item.host] = item
    return min(per_host.values(), key=lambda item: (item.wall, item.rank))


def _seconds_after(first: Failure, later: Failure) -> float:
    """How long after ``first`` ``later`` was seen: by monotonic time on one host."""
    if first.host == later.host:
        return later.mono - first.mono
    return later.wall - first.wall


def first_failed_rank(reports: dict[int, RankReport]) -> int | None:
    """The rank that failed first (see the module docstring), or None when none did."""
    failures = [found for found in map(failure, reports.values()) if found is not None]
    own = [item for item in failures if item.consequence_of is None and not item.stopped]
    if own:
        first = earliest(own)
        if first.signal in CRASHES:
            killed = [item for item in own if item.signal in KILLED_FROM_OUTSIDE
                      and _seconds_after(first, item) < CRASH_WINDOW_SECONDS]
            if killed:
                return earliest(killed).rank
        return first.rank
    blamed = [item for item in failures if item.consequence_of is not None]
    if not blamed:
        return None
    rank = earliest(blamed).consequence_of
    seen = {rank}
    while True:  # a blamed rank that itself blamed another: follow to the source
        found = failure(reports[rank]) if rank in reports else None
        if found is None or found.consequence_of is None or found.consequence_of in seen:
            return rank
        rank = found.consequence_of
        seen.add(rank)


def failure_wall(reports: dict[int, RankReport]) -> float | None:
    """When the job failed, by wall time: when the rank named first failed,
    or, where that rank left no record of it (killed before its supervisor
    could send one), the earliest failure another rank recorded (it saw the
    failure then at the latest). None when no rank recorded a failure time."""
    first = first_failed_rank(reports)
    found = failure(reports[first]) if first in reports else None
    if found is not None and found.wall:
        return found.wall
    walls = [item.wall for item in map(failure, reports.values())
             if item is not None and item.wall]
    return min(walls) if walls else None


def exit_status(reports: dict[int, RankReport]) -> int | None:
    """The exit status of the rank that failed first, for kdrun's own: the
    child's status, 128 plus the signal that killed it, 1 for a rank that left
    with status 0 without finishing; None when no rank failed or the one
    named left no exit record."""
    rank = first_failed_rank(reports)
    exit_record = reports[rank].exit if rank is not None and rank in reports else None
    if exit_record is None or _exit_text(exit_record) is None:
        return None
    if exit_record.get("signal"):
        try:
            return 128 + signals.Signals[exit_record["signal"]].value
        except KeyError:
            return None
    code = exit_record.get("returncode")
    return code if isinstance(code, int) and 0 < code < 256 else 1


def any_failure(reports: dict[int, RankReport]) -> bool:
    """True when some rank's records show a failure."""
    return any(failure(report) is not None for report in reports.values())


def stuck_in_startup(reports: dict[int, RankReport], num_proc: int) -> tuple[list[int], list[int]]:
    """Ranks that failed before init, and the ranks left waiting for them.

    A rank that fails before it starts MPI leaves its peers waiting in MPI
    start-up, and hydra never stops them. That is the case when some rank
    exited with a failure before reporting ``started`` while no rank has
    started and some are still running (no exit record).

    Returns:
        ``(gone, waiting)``, both empty when this is not the case.
    """
    if any(report.started for report in reports.values()):
        return [], []
    gone = sorted(rank for rank, report in reports.items()
                  if report.exit is not None and _exit_text(report.exit) is not None)
    waiting = [rank for rank in range(num_proc)
               if rank not in reports or reports[rank].exit is None]
    if not gone or not waiting:
        return [], []
    return gone, waiting


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _silent_line(silent: dict[str | None, list[int]]) -> str:
    """kdrun's line for ranks, by host, that ended without an exit record."""
    where = ", ".join(f"{', '.join(map(str, ranks))}" + (f" (on {host})" if host else "")
                      for host, ranks in silent.items())
    return (f"kdrun: rank{'s' if sum(map(len, silent.values())) > 1 else ''} {where} ended "
            "without an exit record: stopped by the process manager, or their host was lost.")


def describe_failure(reports: dict[int, RankReport], num_proc: int, returncode: int) -> list[str]:
    """kdrun's lines explaining a failed job: the rank that failed first, then the rest.

    Args:
        reports: ``{rank: RankReport}`` built with ``apply``.
        num_proc: the job's number of ranks.
        returncode: mpiexec's exit status.
    """
    first = first_failed_rank(reports)
    if first is None:
        lines = [f"kdrun: the job failed (mpiexec exit code {returncode}) and no rank "
                 "recorded a failure."]
        silent: dict[str | None, list[int]] = {}
        for rank in range(num_proc):
            report = reports.get(rank, RankReport(rank))
            if report.exit is None:
                silent.setdefault(report.host, []).append(rank)
        if silent:
            lines.append(_silent_line(silent))
        return lines
    lines = []
    report = reports.get(first, RankReport(first))
    found = failure(report)
    if found is not None and found.consequence_of is None:
        lines.append(f"kdrun: {report.where()} failed first: {found.what}")
    else:
        witness = earliest([item for item in map(failure, reports.values())
                            if item is not None and item.consequence_of is not None])
        lines.append(f"kdrun: {report.where()} failed first: it ended before it could "
                     f"record how; rank {witness.rank} reported its failure")
    # A host none of whose ranks left a record of how it ended (not the first
    # failed rank's): stopped by the process manager, or the host was lost,
    # which may be what made the named rank fail. Said apart from the rest.
    everyone = [reports.get(rank, RankReport(rank)) for rank in range(num_proc)]
    hosts: dict[str | None, list[RankReport]] = {}
    for other in everyone:
        hosts.setdefault(other.host, []).append(other)
    silent = {host: [other.rank for other in others] for host, others in hosts.items()
              if host is not None and host != report.host
              and all(other.exit is None and other.error is None for other in others)}
    stopped = []
    for other in everyone:
        if other.rank == first:
            continue
        found = failure(other)
        if found is not None and not found.stopped:
            cause = (f" (after rank {found.consequence_of} failed)"
                     if found.consequence_of is not None else "")
            lines.append(f"kdrun: {other.where()} then {found.what}{cause}")
        elif other.host in silent:
            continue
        elif other.exit is None or found is not None:
            stopped.append(other.rank)
    if silent:
        lines.append(_silent_line(silent))
    if stopped:
        lines.append(f"kdrun: {_ranks(stopped)} stopped when the job ended.")
    return lines
