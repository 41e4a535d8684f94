"""kdrun's verdict on a failed job, from the supervisors' records alone
(``keras_dist.launcher.report``): which rank failed first, and what it says."""

import pickle

import pytest

from keras_dist.errors import PeerFailureError
from keras_dist.launcher import report


def _exit(rank, mono, *, host="h", wall=None, started=True, finished=False, returncode=None,
          signal=None, stopped_by=None, error=None, spawn_error=None):
    return {"event": "exit", "rank": rank, "host": host, "pid": 100 + rank,
            "started": started, "finished": finished, "returncode": returncode,
            "signal": signal, "mono": mono, "wall": mono + 1000 if wall is None else wall,
            "error": error, "stopped_by": stopped_by, "spawn_error": spawn_error}


def _error(rank, mono, *, host="h", wall=None, type_="ValueError", message="bad",
           peer_rank=None):
    return {"event": "error", "rank": rank, "host": host, "pid": 100 + rank,
            "error": {"type": type_, "message": message, "peer_rank": peer_rank,
                      "mono": mono, "wall": mono + 1000 if wall is None else wall}}


def _started(rank, host="h"):
    return {"event": "started", "rank": rank, "host": host, "pid": 100 + rank,
            "mono": 0.0, "wall": 0.0}


def _reports(*records):
    reports = {}
    for record in records:
        report.apply(reports, record)
    return reports


def test_earliest_failure_on_one_host_goes_by_monotonic_time():
    reports = _reports(_started(0), _started(1), _started(2),
                       _exit(2, 5.0, signal="SIGKILL"), _exit(1, 4.0, returncode=3),
                       _exit(0, 6.0, signal="SIGTERM"))
    assert report.first_failed_rank(reports) == 1


def test_monotonic_time_wins_over_wall_time_on_one_host():
    # The wall clock stepped back between the two exits: only monotonic time orders them.
    reports = _reports(_exit(0, 4.0, wall=50.0, returncode=1),
                       _exit(1, 5.0, wall=40.0, returncode=1))
    assert report.first_failed_rank(reports) == 0


def test_failures_on_different_hosts_go_by_wall_time():
    # Monotonic clocks of two machines are unrelated: rank 2's smaller one means nothing.
    reports = _reports(_exit(0, 900.0, host="a", wall=10.5, signal="SIGKILL"),
                       _exit(1, 901.0, host="a", wall=10.7, returncode=1),
                       _exit(2, 3.0, host="b", wall=10.6, returncode=1))
    assert report.first_failed_rank(reports) == 0
    reports = _reports(_exit(0, 900.0, host="a", wall=10.8, signal="SIGKILL"),
                       _exit(2, 3.0, host="b", wall=10.6, returncode=1))
    assert report.first_failed_rank(reports) == 2


def test_a_consequence_is_never_first_even_when_earlier():
    # Rank 0 saw rank 1 die (and said so) before rank 1's supervisor got to record it.
    reports = _reports(_started(0), _started(1),
                       _error(0, 1.0, type_="keras_dist.errors.PeerFailureError", peer_rank=1),
                       _exit(1, 2.0, signal="SIGKILL"))
    assert report.first_failed_rank(reports) == 1


def test_the_blamed_rank_is_named_when_it_left_no_record():
    reports = _reports(_started(0), _started(1), _started(2),
                       _error(2, 3.0, peer_rank=1), _error(0, 2.0, peer_rank=1))
    assert report.first_failed_rank(reports) == 1
    lines = report.describe_failure(reports, 3, 1)
    assert lines[0] == ("kdrun: rank 1 (pid 101 on h) failed first: it ended before it could "
                        "record how; rank 0 reported its failure")
    assert lines[1] == ("kdrun: rank 0 (pid 100 on h) then raised ValueError: bad "
                        "(after rank 1 failed)")


def test_blame_is_followed_to_its_source():
    reports = _reports(_error(0, 1.0, peer_rank=1), _error(1, 0.5, peer_rank=2))
    assert report.first_failed_rank(reports) == 2
    cycle = _reports(_error(0, 1.0, peer_rank=1), _error(1, 0.5, peer_rank=0))
    # Blame in a circle: followed from the earliest report until it comes back.
    assert report.first_failed_rank(cycle) == 1


def test_an_error_counts_from_when_it_was_raised_not_when_the_rank_exited():
    reports = _reports(_error(1, 1.0), _exit(1, 9.0, returncode=1, error={"type": "ValueError"}),
                       _exit(0, 2.0, signal="SIGSEGV"))
    assert report.first_failed_rank(reports) == 1


def test_ranks_stopped_by_a_forwarded_signal_are_not_blamed():
    reports = _reports(_exit(0, 1.0, signal="SIGTERM", stopped_by="SIGTERM"),
                       _exit(1, 2.0, returncode=2))
    assert report.first_failed_rank(reports) == 1
    assert report.first_failed_rank(_reports(
        _exit(0, 1.0, signal="SIGINT", stopped_by="SIGINT"))) is None


def test_exact_ties_name_one_rank():
    reports = _reports(_exit(3, 1.0, signal="SIGKILL"), _exit(2, 1.0, signal="SIGKILL"))
    assert report.first_failed_rank(reports) == 2


def test_a_crash_just_before_a_kill_from_outside_is_taken_for_its_consequence():
    # The killed rank's connections reset before its supervisor saw it die:
    # rank 0's MPI crashed on the reset and was seen 30 ms earlier, on another host.
    crash = _exit(0, 900.0, host="a", wall=10.00, signal="SIGSEGV")
    kill = _exit(2, 5.0, host="b", wall=10.03, signal="SIGKILL")
    assert report.first_failed_rank(_reports(crash, kill)) == 2
    # On one host by monotonic time, with the same window.
    assert report.first_failed_rank(_reports(
        _exit(0, 1.0, signal="SIGABRT"), _exit(1, 1.5, signal="SIGTERM"))) == 1


@pytest.mark.parametrize(
    "later",
    [
        _exit(2, 5.0, host="b", wall=11.5, signal="SIGKILL"),  # outside the window
        _exit(2, 5.0, host="b", wall=10.03, returncode=1),  # not a kill from outside
        _exit(2, 5.0, host="b", wall=10.03, signal="SIGKILL", stopped_by="SIGTERM"),
        _error(2, 5.0, host="b", wall=10.03, peer_rank=0),  # blames the crash
    ],
)
def test_a_crash_stays_first_without_a_kill_from_outside_just_after_it(later):
    crash = _exit(0, 900.0, host="a", wall=10.00, signal="SIGSEGV")
    assert report.first_failed_rank(_reports(crash, later)) == 0


@pytest.mark.parametrize(
    "first, status",
    [
        (_exit(1, 1.0, returncode=3), 3),
        (_exit(1, 1.0, signal="SIGSEGV"), 128 + 11),
        (_exit(1, 1.0, returncode=0), 1),  # left without keras_dist.shutdown()
        (_exit(1, 1.0, returncode=127, started=False, spawn_error="cannot run 'x': gone"), 127),
        (_error(1, 1.0), None),  # no exit record: stopped before it could send one
    ],
)
def test_exit_status_is_that_of_the_rank_named(first, status):
    # Rank 0 ended later, with another status: it is not the one passed on.
    reports = _reports(_started(0), _started(1), first, _exit(0, 2.0, returncode=1))
    assert report.first_failed_rank(reports) == 1
    assert report.exit_status(reports) == status


def test_no_exit_status_without_a_failure():
    assert report.exit_status(_reports(_started(0), _exit(0, 1.0, returncode=0,
                                                          finished=True))) is None


@pytest.mark.parametrize(
    "record, what",
    [
        (_exit(1, 1.0, signal="SIGKILL"), "killed by SIGKILL"),
        (_exit(1, 1.0, returncode=3), "exited with status 3"),
        (_exit(1, 1.0, returncode=0), "exited with status 0 without keras_dist.shutdown() "
                                      "(left the job early)"),
        (_exit(1, 1.0, returncode=1, started=False), "exited with status 1 before "
                                                     "keras_dist.init()"),
        (_exit(1, 1.0, returncode=127, started=False, spawn_error="cannot run 'x': gone"),
         "could not start: cannot run 'x': gone"),
        (_error(1, 1.0, message="first\nsecond"), "raised ValueError: first [...]"),
    ],
)
def test_describe_what_the_first_failed_rank_did(record, what):
    reports = _reports(_started(0), _started(1), record)
    lines = report.describe_failure(reports, 2, 1)
    assert lines == [f"kdrun: rank 1 (pid 101 on h) failed first: {what}",
                     "kdrun: rank 0 stopped when the job ended."]


def test_describe_lists_every_other_rank_once():
    reports = _reports(_started(0), _started(1), _started(2),
                       _exit(1, 1.0, signal="SIGKILL"),
                       _error(0, 2.0, type_="keras_dist.errors.PeerFailureError",
                              message="rank 1 died", peer_rank=1),
                       _exit(3, 3.0, returncode=0, started=False, finished=False))
    assert report.describe_failure(reports, 5, 9) == [
        "kdrun: rank 1 (pid 101 on h) failed first: killed by SIGKILL",
        "kdrun: rank 0 (pid 100 on h) then raised keras_dist.errors.PeerFailureError: "
        "rank 1 died (after rank 1 failed)",
        "kdrun: ranks 2, 4 stopped when the job ended.",
    ]


def test_describe_names_a_silent_host_apart_from_the_ranks_stopped():
    # Host b was lost: nothing there recorded an end, while rank 0 on host a
    # crashed (its MPI connection to b gone) and rank 1 was stopped.
    reports = _reports(_started(0, "a"), _started(1, "a"), _started(2, "b"), _started(3, "b"),
                       _exit(0, 1.0, host="a", signal="SIGSEGV"))
    assert report.describe_failure(reports, 4, 255) == [
        "kdrun: rank 0 (pid 100 on a) failed first: killed by SIGSEGV",
        "kdrun: ranks 2, 3 (on b) ended without an exit record: stopped by the process "
        "manager, or their host was lost.",
        "kdrun: rank 1 stopped when the job ended."]
    # A host with one rank that recorded its end is not silent.
    reports = _reports(_started(0, "a"), _started(1, "b"), _started(2, "b"),
                       _exit(0, 1.0, host="a", signal="SIGSEGV"),
                       _exit(2, 2.0, host="b", signal="SIGTERM", stopped_by="SIGTERM"))
    assert report.describe_failure(reports, 3, 255) == [
        "kdrun: rank 0 (pid 100 on a) failed first: killed by SIGSEGV",
        "kdrun: ranks 1, 2 stopped when the job ended."]


def test_describe_without_any_failure_recorded():
    assert report.describe_failure(_reports(_started(0)), 2, 7) == [
        "kdrun: the job failed (mpiexec exit code 7) and no rank recorded a failure.",
        "kdrun: ranks 0 (on h), 1 ended without an exit record: stopped by the process "
        "manager, or their host was lost."]
    reports = _reports(_started(0, "a"), _started(1, "a"), _started(2, "b"),
                       _exit(3, 1.0, host="b", returncode=0, finished=True))
    assert report.describe_failure(reports, 4, 255)[1] == (
        "kdrun: ranks 0, 1 (on a), 2 (on b) ended without an exit record: stopped by the "
        "process manager, or their host was lost.")
    assert not report.any_failure(_reports(_started(0), _exit(1, 1.0, returncode=0,
                                                                 finished=True)))


def test_stuck_in_startup():
    # Rank 1 failed before init; ranks 0 and 2 have not started and still run.
    reports = _reports(_exit(1, 1.0, returncode=1, started=False))
    assert report.stuck_in_startup(reports, 3) == ([1], [0, 2])
    # Once any rank started, MPI start-up is over: the process manager handles the rest.
    assert report.stuck_in_startup(_reports(_exit(1, 1.0, returncode=1, started=False),
                                            _started(0)), 3) == ([], [])
    # A rank that ran and ended cleanly without keras_dist (a plain program) is no failure.
    assert report.stuck_in_startup(_reports(_exit(1, 1.0, returncode=0, started=False)),
                                   2) == ([], [])
    # Everyone has ended: nobody waits.
    assert report.stuck_in_startup(_reports(_exit(0, 1.0, returncode=1, started=False),
                                            _exit(1, 1.0, returncode=1, started=False)),
                                   2) == ([], [])


def test_malformed_records_are_ignored():
    reports = _reports({"event": "exit"}, {"rank": "1", "event": "exit"}, {"rank": 0},
                       {"rank": 0, "event": "bogus"}, _error(0, 1.0) | {"error": "x"})
    assert list(reports) == [0] and reports[0].error is None and reports[0].exit is None


def test_peer_failure_error_keeps_its_peer_through_pickling():
    error = pickle.loads(pickle.dumps(PeerFailureError("rank 3 died", peer_rank=3)))
    assert str(error) == "rank 3 died" and error.peer_rank == 3
    assert PeerFailureError("x").peer_rank is None


@pytest.mark.parametrize(
    "message, peer",
    [
        ("shm barrier #2 on rank 0: rank 1 (pid 7) died while this rank waited for it", 1),
        ("shm allreduce #3 (float32, sum, 4 bytes) on rank 2: cannot read the buffer of "
         "rank 11 (pid 5): the process died", 11),
        ("shm broadcast #4 (root 0, 8 bytes) on rank 0: rank 3 (local rank 1) aborted: x", 3),
        ("shm barrier #2 on local rank 0: local rank 1 (pid 7) died while this rank waited", None),
    ],
)
def test_native_peer_failures_name_their_peer(message, peer):
    from keras_dist import _native
    from keras_dist.transports import shm

    translated = shm.translate(_native.PeerFailureError(message))
    assert isinstance(translated, PeerFailureError) and translated.peer_rank == peer


def test_the_failure_time_is_the_named_ranks_else_the_earliest_recorded():
    reports = _reports(_started(0), _started(1), _exit(1, 2.0, wall=20.0, signal="SIGKILL"),
                       _error(0, 1.0, wall=19.0, peer_rank=1))
    assert report.failure_wall(reports) == 20.0  # the named rank's, though later
    # Rank 1 was killed before its supervisor recorded it: the others saw it fail by then.
    silent = _reports(_started(0), _started(1), _started(2),
                      _error(2, 3.0, wall=31.0, peer_rank=1), _error(0, 2.0, wall=30.5,
                                                                    peer_rank=1))
    assert report.first_failed_rank(silent) == 1
    assert report.failure_wall(silent) == 30.5
    assert report.failure_wall(_reports(_started(0), _started(1))) is None
