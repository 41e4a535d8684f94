"""Runs a worker's checks one after another and reports every one of them.

Usage, at the end of a worker::

    from tests.multiprocess.workers._checks import run_checks

    run_checks([check_a, check_b], rank=RANK, passed="ADASUM {name} passed rank={rank}",
               agree=kd.allgather_object)
    print(f"ADASUM OK rank={RANK}")  # reached only when every check passed

Each check prints ``CHECK <name> ok rank=R`` then the worker's own marker
(``passed``, the line its driver looks for), or ``CHECK <name> FAILED rank=R:
<file:line>: <error>`` with the full traceback on stderr. Once the checks are
done, a rank where any failed prints ``CHECKS FAILED rank=R: a, b`` and exits
with status 1, so the worker's closing marker is not printed.
``tests/_mp.py``'s ``describe()`` lists every ``FAILED`` line of every rank
at the top of a job's output.

Collective order. A worker's checks run the same collectives in the same
order on every rank. A check that fails on every rank (the usual case: each
rank computes every rank's reference, so a wrong value fails everywhere, after
the same collectives) leaves the ranks in step, and the next check runs. A
check that fails on some ranks only may leave the others inside a collective
that the failed ranks never enter, and running further checks would pair
unrelated collectives. So after each check the ranks agree on its outcome
(``agree``, one ``allgather_object`` of a bool): when the outcome differs
between ranks, the remaining checks are reported ``NOT RUN`` and the worker
exits. If the ranks are already out of step, that agreement pairs with a
collective of the check still running elsewhere: keras_dist raises there (a
mismatch, a bounded wait) or, at worst, the job's hard timeout ends it; the
first ``FAILED`` line names the check that broke either way.

``agree=None`` (for checks that leave no group to agree in) runs every check
whatever happened before it.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Sequence


def _summary(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    where = f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}: " if frames else ""
    lines = traceback.format_exception_only(type(error), error)
    text = " ".join(line.strip() for line in lines if line.strip())
    return where + (text if len(text) <= 600 else text[:600] + " [...]")


def run_checks(
    checks: Sequence[Callable[[], object]],
    *,
    rank: int,
    passed: str | None = None,
    agree: Callable[[object], list] | None = None,
) -> None:
    """Runs every check, prints each one's outcome, and exits 1 if any failed.

    Args:
        checks: functions without arguments; a check fails by raising.
        rank: this process's rank, for the printed lines.
        passed: the worker's own success marker, formatted with ``name`` and
            ``rank`` and printed after ``CHECK <name> ok``.
        agree: ``kd.allgather_object`` (or the like) to compare the ranks'
            outcomes after each check; ``None`` to run every check regardless.

    Returns:
        Only when every check passed on this rank.
    """
    failed: list[str] = []
    for index, check in enumerate(checks):
        name = check.__name__
        try:
            check()
        except Exception as error:  # noqa: BLE001 -- reported, then the next check runs
            failed.append(name)
            print(f"CHECK {name} FAILED rank={rank}: {_summary(error)}", flush=True)
            print(f"----- check {name} on rank {rank}:", file=sys.stderr)
            traceback.print_exc()
            sys.stderr.flush()
        else:
            print(f"CHECK {name} ok rank={rank}", flush=True)
            if passed is not None:
                print(passed.format(name=name, rank=rank), flush=True)
        if agree is None:
            continue
        try:
            outcomes = agree(failed[-1:] == [name])
        except Exception as error:  # noqa: BLE001
            failed.append("<agreement>")
            print(f"CHECK <agreement after {name}> FAILED rank={rank}: {_summary(error)}",
                  flush=True)
            traceback.print_exc()
            outcomes = None
        if outcomes is None or len(set(outcomes)) > 1:
            if outcomes is not None:
                bad = [r for r, failed_there in enumerate(outcomes) if failed_there]
                print(f"CHECKS out of step rank={rank}: {name} failed on rank(s) {bad} only",
                      flush=True)
            for later in checks[index + 1:]:
                print(f"CHECK {later.__name__} NOT RUN rank={rank}", flush=True)
            break
    if failed:
        print(f"CHECKS FAILED rank={rank}: {', '.join(failed)}", flush=True)
        sys.exit(1)
