"""The cost model of a step across hosts (benchmarks/emulated_hosts_cost.py): its
fit recovers a known allreduce cost, and run on the committed measurements it
prints every measured point beside its fitted value and predicts the CNN's and
a 100 M-parameter model's step at 16, 64 and 256 hosts."""

import re

import numpy as np
import pytest

from benchmarks import emulated_hosts_cost as cost


@pytest.mark.parametrize("form", sorted(cost.LATENCY))
def test_the_fit_recovers_a_known_allreduce_cost(form):
    alpha, beta = 2e-3, 1 / 80e6
    points = [(hosts, nbytes, float(cost.ring_seconds((alpha, beta, form), nbytes, hosts)), 1e8)
              for hosts in (2, 4, 8) for nbytes in (4 << 10, 1 << 20, 64 << 20)]
    fitted = cost.fit_ring(points, form)
    np.testing.assert_allclose(fitted[:2], (alpha, beta), rtol=1e-9)
    assert cost.relative_error(fitted, points) < 1e-9


def test_the_committed_measurements_are_fitted_and_extrapolated(capsys):
    assert cost.main([]) == 0
    out = capsys.readouterr().out
    assert re.search(r"# used: L\(H\) = (constant|log2|ring)", out), out
    # every allreduce point and every training step, measured beside fitted
    for peer in ("kd", "mpi", "gloo"):
        assert re.search(rf"^\s*{peer}\s+\d+\s+\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+$", out, re.M), out
    for config in ("keras_dist", "keras_dist-fp16", "DDP"):
        for model in ("mlp", "cnn"):
            assert re.search(rf"^\s*{model}\s+{config}\s+[24]\s+[\d.]+\s+[\d.]+", out, re.M), out
    # predictions: 3 configurations x 2 rates for each of the two models
    rows = re.findall(r"^\s*(cnn|100M)\s+\S+\s+(10|100)\s+(.*)$", out, re.M)
    assert len(rows) == 12, out
    for _, _, cells in rows:
        assert len(re.findall(r"[\d.]+ \(\s*[\d.]+\)", cells)) == 3, out
