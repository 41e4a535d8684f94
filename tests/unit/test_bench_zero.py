"""keras_dist.bench.zero_memory, tiny, in one process (the multi-rank run is in docs/zero.md)."""

import json

import pytest

from keras_dist.bench import zero_memory


@pytest.mark.parametrize("mode", ["unsharded", "sharded"])
def test_zero_memory_reports_state_memory_and_step_time(mode, capsys):
    zero_memory.main(["--params", "3000", "--width", "16", "--steps", "1", "--mode", mode])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("ZERO ")
    result = json.loads(line[len("ZERO "):])
    assert result["mode"] == mode and result["size"] == 1
    # Adam: two moments per weight (plus its iteration count and learning rate).
    assert result["optimizer_state_bytes"] >= 2 * 4 * result["parameters"]
    assert result["peak_rss_bytes"] > 0 and result["median_step_s"] > 0
