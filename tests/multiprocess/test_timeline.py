"""``kdrun --timeline``: one Chrome trace with every rank, waits and moves, steps, names."""

import collections
import json
import os

import pytest

from tests._mp import run_job

WORKER = "tests/multiprocess/workers/timeline_fit.py"
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}


def _events(path):
    with open(path) as trace:
        return json.load(trace)["traceEvents"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np_", [1, 2])
def test_timeline_holds_every_rank(np_, tmp_path):
    path = tmp_path / "trace.json"
    result = run_job(WORKER, np=np_, timeout=120, env=ENV, kdrun_args=["--timeline", str(path)])
    result.check()
    written = "timeline of ranks 0-1 written" if np_ == 2 else "timeline written"
    assert written in result.launcher_stderr, result.describe()
    assert not [p for p in os.listdir(tmp_path) if ".rank" in p], "parts left behind"
    events = _events(path)
    paths = result.output(0).split("PATHS ")[1].split()[0].split(",")
    batches = int(result.output(0).split("BATCHES ")[1].split()[0])
    names = {(e["pid"], e["args"]["name"]) for e in events
             if e.get("ph") == "M" and e["name"] == "process_name"}
    assert names == {(r, f"rank {r}") for r in range(np_)}
    for rank in range(np_):
        assert f"keras_dist timeline rank {rank}: {batches} steps" in result.output(rank), \
            result.describe()
        mine = [e for e in events if e.get("pid") == rank and e.get("ph") == "X"]
        steps = [e for e in mine if e["name"].startswith("step ")]
        assert len(steps) == batches
        calls = [e for e in mine if e["name"] in ("allreduce", "allgather", "broadcast")]
        counts = collections.Counter(e["args"]["name"] for e in calls)
        if np_ == 1:  # size 1: no collective runs, so none is recorded
            assert not calls, calls
            continue
        assert counts["probe_allreduce"] == 1 and counts["probe_allgather"] == 1, counts
        gradient_calls = [e for e in calls if e["args"].get("tensors")]
        assert len(gradient_calls) == batches
        assert all(e["args"]["tensors"] == paths for e in gradient_calls)
        # Every collective holds a wait and a move span that tile it.
        parts = {(e["name"], e["ts"]): e for e in mine if e["name"] in ("wait for peers",
                                                                        "move data")}
        for call in calls:
            wait = parts[("wait for peers", call["ts"])]
            move = [e for e in mine if e["name"] == "move data"
                    and abs(e["ts"] - (call["ts"] + wait["dur"])) < 0.01]
            assert move and abs(wait["dur"] + move[0]["dur"] - call["dur"]) < 0.01, call
        # Steps and collectives sit on separate tracks.
        assert {e["tid"] for e in steps} != {e["tid"] for e in calls}
