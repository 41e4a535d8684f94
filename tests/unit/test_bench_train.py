"""``python -m keras_dist.bench train`` pieces without MPI, and the plots."""

import sys

import numpy as np
import pytest

from keras_dist.bench import plot, train


def test_defaults_and_bad_arguments():
    args = train.parse_args([])
    assert (args.model, args.batch_size, args.threads) == ("cnn", 32, 1)
    for argv in (["--batch-size", "0"], ["--num-iters", "0"], ["--num-warmup-batches", "-1"],
                 ["--model", "vgg"], ["--model", "NoSuchApplication"],
                 ["--image-size", "0"]):
        with pytest.raises(SystemExit):
            train.parse_args(argv)


def test_summary_is_horovods_mean_and_spread_plus_median():
    rng = np.random.default_rng(3)
    samples = rng.normal(100.0, 5.0, size=9)
    mean, spread, median = train.summarize(samples)
    assert mean == pytest.approx(float(np.float64(samples).sum() / 9))
    assert spread == pytest.approx(1.96 * float(np.sqrt(((samples - mean) ** 2).mean())))
    assert median == pytest.approx(float(sorted(samples)[4]))


def test_ratios_and_breakdown():
    medians = {"single": 200.0, "kd1": 198.0, "independent": 150.0, "kd": 141.0}
    got = train.ratios(medians, 2)
    assert got["np1_overhead"] == pytest.approx(0.01)
    assert got["efficiency"] == pytest.approx(0.94)
    assert "efficiency" not in train.ratios(medians, 1)
    row = train.breakdown_row(10.0, 8.0, 1.0, 0.5)
    assert "baseline    8.00" in row and row.endswith("0.50")


def test_cores_say_whether_the_ranks_are_pinned():
    one_host = ["a", "a"]
    assert train.describe_cores([[0, 1], [1, 0]], [2, 2], one_host) == \
        "not pinned (each rank may run on any of cores 0,1)"
    assert train.describe_cores([[0], [1]], [2, 2], one_host) == \
        "pinned: rank 0 on 0, rank 1 on 1"
    assert train.describe_cores([[2, 3], [0, 1]], [4, 4], one_host) == \
        "pinned: rank 0 on 2,3, rank 1 on 0,1"
    assert train.describe_cores([[0]], [2], ["a"]) == "pinned: rank 0 on 0"
    # One core is all a one-core machine has: not pinned.
    assert train.describe_cores([[0]], [1], ["a"]) == \
        "not pinned (each rank may run on any of cores 0)"
    # A container limited to cores 2,3 of 8: the ranks share them.
    assert train.describe_cores([[2, 3], [3, 2]], [8, 8], one_host) == \
        "not pinned (each rank may run on any of cores 2,3)"
    # Two hosts of different sizes, neither rank restricted.
    assert train.describe_cores([[0, 1], [0, 1, 2, 3]], [2, 4], ["a", "b"]) == \
        "not pinned (each rank may run on any core of its host)"
    # The same core on two hosts is two cores.
    assert train.describe_cores([[0], [0]], [2, 2], ["a", "b"]) == \
        "pinned: rank 0 on 0, rank 1 on 0"
    assert train.describe_cores([[0], [0, 1]], [2, 2], one_host) == \
        "partly pinned: rank 0 on 0, rank 1 on any of 0,1"


def test_block_order_swaps_each_pair_every_other_iteration():
    kinds = ["single", "kd1", "independent", "kd"]
    assert train.block_order(kinds, 0) == kinds
    assert train.block_order(kinds, 1) == ["kd1", "single", "kd", "independent"]
    assert train.block_order(kinds, 2) == kinds
    assert train.block_order(["single", "kd1"], 3) == ["kd1", "single"]


def test_jitter_wait_is_the_mean_slowest_minus_each_ranks_mean():
    rng = np.random.default_rng(5)
    steady = np.full(50, 2.0)
    # Against a rank that always takes 2.0, a rank taking 1.0 or 3.0 with equal
    # odds makes every step 2.5 on average: waits 0.5 and 0.5.
    coin = rng.choice([1.0, 3.0], size=4000)
    got = train.jitter_wait([steady, coin])
    assert got[0] == pytest.approx(0.5, abs=0.02)
    assert got[1] == pytest.approx(2.5 - coin.mean(), abs=0.02)
    # No jitter, no wait; one rank alone never waits.
    assert train.jitter_wait([steady, steady]) == [0.0, 0.0]
    assert train.jitter_wait([coin]) == [pytest.approx(0.0, abs=0.02)]


def test_sync_ceiling_is_the_plain_step_over_the_step_with_its_wait():
    rng = np.random.default_rng(6)
    steady = np.full(50, 2.0)
    coin = rng.choice([1.0, 3.0], size=4000)
    # Each rank waits until 2.5 on average: 2.0 / 2.5 and coin.mean() / 2.5.
    ceiling = train.sync_ceiling([steady, coin], train.jitter_wait([steady, coin]))
    assert ceiling == pytest.approx((2.0 / 2.5 + coin.mean() / 2.5) / 2, abs=0.01)
    assert train.sync_ceiling([steady, steady], [0.0, 0.0]) == 1.0


@pytest.mark.parametrize("name", train.MODELS)
def test_models_build_with_their_input_shape(name):
    model = train.build_model(name)
    assert tuple(model.input_shape[1:]) == train.input_shape(name)
    assert model.output_shape == (None, 10)
    assert 1e4 < model.count_params() < 2e6


def tiny_model():
    """A model from outside the benchmark (``--model tests.unit.test_bench_train:tiny_model``)."""
    import keras

    inputs = keras.Input((5, 3))
    return keras.Model(inputs, keras.layers.Dense(7)(keras.layers.Flatten()(inputs)))


def test_random_batch_draws_token_ids_below_the_vocabulary_and_fills_open_lengths():
    import keras

    tokens = keras.Input((None,), dtype="int32")
    image = keras.Input((4, 4, 1))
    x = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 8)(tokens))
    y = keras.layers.Flatten()(image)
    model = keras.Model([tokens, image], keras.layers.Dense(3)(
        keras.layers.Concatenate()([x, y])))
    (ids, pixels), labels = train.random_batch(model, 6, np.random.default_rng(0))
    assert ids.shape == (6, 16) and ids.dtype == np.int32
    assert ids.min() >= 0 and ids.max() < 50 and len(np.unique(ids)) > 10
    assert pixels.shape == (6, 4, 4, 1) and pixels.dtype == np.float32 and pixels.std() > 0.5
    assert labels.shape == (6,) and labels.min() >= 0 and labels.max() < 3
    single, labels = train.random_batch(tiny_model(), 2, np.random.default_rng(1))
    assert single.shape == (2, 5, 3) and labels.shape == (2,) and labels.max() < 7


def test_other_models_keras_applications_and_module_function():
    args = train.parse_args(["--model", "MobileNetV2", "--image-size", "40"])
    model = train.build_model(args.model, args.image_size)
    assert model.input_shape == (None, 40, 40, 3) and model.output_shape == (None, 10)
    assert model.layers[-1].activation.__name__ == "linear"  # logits, as the loss expects
    model = train.build_model(f"{__name__}:tiny_model")
    assert model.input_shape == (None, 5, 3) and model.output_shape == (None, 7)
    with pytest.raises(ValueError, match="has no function 'missing'"):
        train.build_model(f"{__name__}:missing")
    with pytest.raises(TypeError, match="must return a keras.Model. Received: str"):
        train.build_model("os:getcwd")


def test_plots_write_png_files(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    bars, lines = tmp_path / "bars.png", tmp_path / "lines.png"
    plot.train_bars(str(bars), ["a", "b"], [10.0, 12.5], "title")
    plot.bandwidth_lines(str(lines), [4, 64, 1024], {"x": [0.1, 0.5, 2.0]}, "title")
    for path in (bars, lines):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install matplotlib` \(the extra plot of "):
        plot.train_bars(str(tmp_path / "x.png"), ["a"], [1.0], "t")
