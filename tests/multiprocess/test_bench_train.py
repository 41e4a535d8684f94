"""A tiny run of ``python -m keras_dist.bench train`` at 1 and 2 ranks."""

import re
import sys

import pytest

from tests._mp import run_job

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np_", [1, 2])
def test_train_benchmark_reports_every_kind(np_, tmp_path):
    png = tmp_path / "train.png"
    command = [sys.executable, "-m", "keras_dist.bench", "train", "--model", "mlp",
               "--batch-size", "8", "--num-iters", "2", "--num-batches-per-iter", "2",
               "--num-warmup-batches", "1", "--breakdown", "--plot", str(png),
               *(["--fp16-allreduce"] if np_ == 2 else [])]
    result = run_job(command, np=np_, timeout=150, env=ENV, hide=())  # --plot: matplotlib
    result.check()
    out = result.output(0)
    kinds = ["plain Keras, 1 process", "keras_dist, size 1"]
    if np_ == 2:
        kinds += ["plain Keras, 2 processes at once", "keras_dist, 2 ranks"]
    for kind in kinds:
        assert re.search(re.escape(kind) + r" +[\d.]+ \+- +[\d.]+ img/sec per rank", out), \
            result.describe()
    assert "np=1 overhead:" in out
    assert ("gradients sent as float16" in out) == (np_ == 2), result.describe()
    assert re.search(r"^Cores: (not pinned|pinned: rank 0 on)", out, flags=re.M), \
        result.describe()
    assert ("scaling efficiency:" in out) == (np_ == 2)
    if np_ == 2:
        for rank in range(2):
            assert re.search(rf"rank {rank}: step +[\d.]+ ms = baseline", out), result.describe()
        assert re.search(r"jitter alone implies .*: rank 0 -?[\d.]+ ms, rank 1 -?[\d.]+ ms",
                         out), result.describe()
        assert re.search(r"jitter leaves to any synchronous step .*: [\d.]+%", out), \
            result.describe()
    assert png.read_bytes()[:4] == b"\x89PNG"
