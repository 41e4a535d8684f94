"""keras_dist.bench.zero_memory, tiny, in one process (the multi-rank run is in docs/zero.md).

``--threads 0``: this process's TensorFlow may have started already (other
tests ran before), and then its thread counts cannot change."""

import json

import pytest

from keras_dist.bench import zero_memory


@pytest.mark.parametrize("mode", ["unsharded", "sharded"])
def test_zero_memory_reports_state_memory_and_step_time(mode, capsys):
    zero_memory.main(["--params", "3000", "--width", "16", "--steps", "1", "--mode", mode,
                      "--threads", "0"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("ZERO ")
    result = json.loads(line[len("ZERO "):])
    assert result["mode"] == mode and result["size"] == 1
    # Adam: two moments per weight (plus its iteration count and learning rate).
    assert result["optimizer_state_bytes"] >= 2 * 4 * result["parameters"]
    assert result["peak_rss_bytes"] > 0 and result["median_step_s"] > 0


def test_zero_memory_breakdown_samples_the_peak(capsys):
    zero_memory.main(["--params", "3000", "--width", "16", "--steps", "2", "--mode", "sharded",
                      "--breakdown", "--threads", "0"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1][len("ZERO "):])
    assert result["median_step_cpu_s"] > 0
    # One rank: no collective runs, so a sampled peak falls between collectives.
    assert result.get("sampled_peak_in", "between collectives") == "between collectives"


def test_breakdown_counts_each_collective_by_what_it_moves(tmp_path):
    part = tmp_path / "timeline.json.rank0"
    part.write_text(
        '{"name":"allreduce","ph":"X","ts":0,"dur":4000000000,"args":{"name":"allreduce"}}\n'
        '{"name":"wait for peers","ph":"X","ts":0,"dur":1000000000}\n'
        '{"name":"move data","ph":"X","ts":1000000000,"dur":3000000000}\n'
        '{"name":"allreduce","ph":"X","ts":5000000000,"dur":2000000000,'
        '"args":{"name":"sharded weights"}}\n')
    assert zero_memory._breakdown(str(part), 2) == {
        "exchange_s": 1.0, "gradients_move_s": 1.5, "gradients_s": 2.0, "gradients_wait_s": 0.5}
    assert zero_memory._peak_phase(str(part), [(1, 10), (6000000000, 20)]) == {
        "sampled_peak_rss_bytes": 20, "sampled_peak_in": "exchange"}
