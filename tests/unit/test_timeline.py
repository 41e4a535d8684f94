"""The timeline at size 1: recording, the off path, merging parts (also cut-short ones)."""

import json
import os

import numpy as np
import pytest

import keras_dist as kd
from keras_dist._runtime import timeline

pytestmark = pytest.mark.usefixtures("initialised")


class _FakeTransport:
    """Waits 0.25 s of every call, as a transport's counter would say."""

    def __init__(self):
        self.total = 1.0

    def wait_seconds(self):
        self.total += 0.25
        return self.total


class _FakeClock:
    """The timeline's clock (``timeline.now_ns``), moved on by the test alone."""

    def __init__(self, ns: int):
        self.ns = ns

    def __call__(self) -> int:
        return self.ns


def test_off_path_records_nothing_and_shares_one_context(tmp_path):
    assert not timeline.enabled()
    first = timeline.activity("a", "allreduce", 4)
    assert first is timeline.activity("b", "broadcast", 8, _FakeTransport())
    with first:
        pass
    assert not list(tmp_path.iterdir())


def test_spans_split_into_wait_and_move_and_merge(tmp_path, capsys, monkeypatch):
    clock = _FakeClock(1_700_000_000_000_000_000)
    monkeypatch.setattr(timeline, "now_ns", clock)
    path = tmp_path / "t.json"
    kd.start_timeline(str(path))
    with pytest.raises(ValueError, match="already being recorded"):
        kd.start_timeline(str(path))
    assert timeline.enabled()
    with timeline.tensor_names(["dense/kernel", "dense/bias"]):
        with timeline.activity("grads", "allreduce", 64, _FakeTransport()):
            clock.ns += 1_000_000_000  # the call lasts 1 s, of which it waited 0.25 s
    start = timeline.now_ns()
    timeline.record_step("step 0:0", start, start + 5_000_000)
    kd.stop_timeline()
    kd.stop_timeline()  # twice is fine
    assert capsys.readouterr().err == (
        "keras_dist timeline rank 0: 1 steps, 0.005 s in steps; 1 collectives: "
        "0.250 s waiting for peers, 0.750 s moving data\n")
    # One rank: stop_timeline merged the part already.
    assert not os.path.exists(timeline.part_path(str(path), 0))
    assert timeline.merge(str(path)) == []
    events = json.loads(path.read_text())["traceEvents"]
    spans = {e["name"]: e for e in events if e["ph"] == "X"}
    call, wait, move = spans["allreduce"], spans["wait for peers"], spans["move data"]
    assert call["args"] == {"bytes": 64, "name": "grads",
                            "tensors": ["dense/kernel", "dense/bias"]}
    assert (call["ts"], call["dur"]) == (0.0, 1_000_000.0)
    assert (wait["ts"], wait["dur"]) == (0.0, 250_000.0)
    assert (move["ts"], move["dur"]) == (250_000.0, 750_000.0)
    assert (spans["step 0:0"]["ts"], spans["step 0:0"]["dur"]) == (1_000_000.0, 5000.0)
    assert spans["step 0:0"]["tid"] != call["tid"]


def test_merge_keeps_whole_lines_of_a_part_cut_short(tmp_path):
    path = str(tmp_path / "t.json")
    rows = [{"name": "allreduce", "ph": "X", "pid": r, "tid": 2, "ts": 1_000_000 + 1000 * r,
             "dur": 2000} for r in range(3)]
    for rank, row in enumerate(rows):
        with open(timeline.part_path(path, rank), "w") as part:
            part.write(json.dumps(row) + "\n")
            if rank == 2:
                part.write('{"name": "allred')  # the rank died while writing
    with open(path + ".rank1.bak", "w") as other:  # not a part
        other.write("x")
    assert timeline.merge(path) == [0, 1, 2]
    events = json.loads(open(path).read())["traceEvents"]
    assert [(e["pid"], e["ts"], e["dur"]) for e in events] == [(0, 0.0, 2.0), (1, 1.0, 2.0),
                                                               (2, 2.0, 2.0)]
    assert os.path.exists(path + ".rank1.bak")
    assert timeline.merge(str(tmp_path / "none.json")) == []


def test_collectives_at_size_one_record_nothing(tmp_path):
    path = str(tmp_path / "t.json")
    kd.start_timeline(path)
    kd.allreduce(np.ones(3))
    timeline.stop_timeline(summary=False)
    events = json.loads(open(path).read())["traceEvents"]
    assert not [e for e in events if e["ph"] == "X"]


def test_merge_command_line(tmp_path, capsys):
    assert timeline.main([str(tmp_path / "missing.json")]) == 1
    assert timeline.main([]) == 2
    path = str(tmp_path / "t.json")
    with open(timeline.part_path(path, 0), "w") as part:
        part.write(json.dumps({"name": "x", "ph": "X", "pid": 0, "tid": 1, "ts": 5, "dur": 1})
                   + "\n")
    assert timeline.main([path]) == 0
    assert "ranks [0]" in capsys.readouterr().out
