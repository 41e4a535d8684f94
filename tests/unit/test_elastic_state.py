"""Unit tests of keras_dist.elastic in one process: the state classes, the
store, the epoch/batch counters, ElasticData's re-sharding, kdrun's options."""

import os
import types

import numpy as np
import pytest

import keras_dist as kd
from keras_dist.elastic import ElasticData, ObjectState, progress
from keras_dist.elastic.store import Store
from keras_dist.launcher.elastic import cleanup_command, placement, trim
from keras_dist.launcher.options import UsageError, parse_args


@pytest.fixture(autouse=True, scope="module")
def initialised():
    kd.init()
    yield


def test_object_state_commit_restore_and_reset_callbacks():
    state = ObjectState(epoch=0, values=[1, 2])
    state.commit()
    state.epoch = 5
    state.values.append(3)
    state.restore()
    assert state.epoch == 0 and state.values == [1, 2]
    calls = []
    state.reset = lambda: calls.append("reset")
    state.register_reset_callbacks([lambda: calls.append("a"), lambda: calls.append("b")])
    state.on_reset()
    assert calls == ["reset", "a", "b"]
    with pytest.raises(TypeError, match="callable"):
        state.register_reset_callbacks([3])


def test_sync_outside_an_elastic_job_keeps_the_state():
    state = ObjectState(step=7)
    state.sync()
    assert state.step == 7 and state.resumed_from is None
    state.check_host_updates()  # no kdrun notices outside an elastic job: nothing raised


def test_keras_state_checks_and_round_trip():
    import keras

    model = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="built model"):
        kd.elastic.KerasState(model)
    model.build((None, 3))
    with pytest.raises(ValueError, match="optimizer"):
        kd.elastic.KerasState(model)
    optimizer = keras.optimizers.Adam(0.1)
    state = kd.elastic.KerasState(model, optimizer=optimizer, epoch=1)
    assert optimizer.built
    before = [keras.ops.convert_to_numpy(v) for v in model.variables]
    state.commit()
    model.variables[0].assign(np.random.default_rng(0).normal(size=(3, 2)))
    state.epoch = 9
    state.restore()
    for variable, value in zip(model.variables, before):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), value)
    assert state.epoch == 1


def test_keras_state_commits_a_sharded_optimizer_in_the_unsharded_layout():
    """A sharded optimizer's commit holds the same arrays as its unsharded twin's
    (the layout kd.save_model writes), and restores into either (one rank here;
    tests/elastic/test_elastic_sharded.py re-shards at 3 -> 2 -> 3 ranks)."""
    import keras

    rng = np.random.default_rng(3)
    initial = [rng.normal(size=(3, 4)), np.zeros(4), rng.normal(size=(4, 2)), np.zeros(2)]
    x, y = rng.normal(size=(8, 3)), rng.normal(size=(8, 2))

    def trained(shard):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                                  keras.layers.Dense(2)])
        model.set_weights(initial)
        model.compile(loss="mse", optimizer=kd.DistributedOptimizer(
            keras.optimizers.Adam(0.1), shard_optimizer_state=shard))
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        return model, kd.elastic.KerasState(model, epoch=0)

    (sharded, state), (_, twin) = trained(True), trained(False)
    committed, _ = state._capture()
    expected, _ = twin._capture()
    assert [np.shape(a) for a in committed] == [np.shape(a) for a in expected]
    for got, want in zip(committed, expected):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    state.commit()
    for variable in sharded.variables + sharded.optimizer.variables:
        variable.assign(keras.ops.ones_like(variable))
    state.restore()
    for got, want in zip(state._capture()[0], committed):
        np.testing.assert_array_equal(got, want)
    state._apply(expected, {"epoch": 0})  # the unsharded twin's commit
    for got, want in zip(state._capture()[0], expected):
        np.testing.assert_array_equal(got, want)


def test_store_keeps_the_newest_whole_commit(tmp_path):
    store = Store("job", base=str(tmp_path), host="h")
    assert store.newest() == -1
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array(4)]
    store.write(1, arrays, {"commit": 1, "objects": {"a": [1]}})
    store.write(2, [a + 1 for a in arrays], {"commit": 2})
    # A writer killed mid-write leaves a temporary file: ignored, then removed.
    (tmp_path / "keras_dist-elastic-job" / "h" / "commit-3.npz.999999999.tmp").write_bytes(b"x")
    assert store.newest() == 2
    read, meta = store.read(2)
    assert meta == {"commit": 2}
    for got, want in zip(read, arrays):
        np.testing.assert_array_equal(got, want + 1)
    store.write(3, arrays, {"commit": 3})
    assert sorted(os.listdir(store.path)) == ["commit-3.npz"]
    store.remove_job()
    assert not (tmp_path / "keras_dist-elastic-job").exists()


class _Model:
    stop_training = False


def _fit(track, model, epochs, first_epoch, steps, stop_at=None):
    """Drives Progress through fit's events; returns (epoch, batch) after each batch."""
    seen = []
    track.begin_train(model, {"steps": steps})
    for epoch in range(first_epoch, epochs):
        track.begin_epoch(epoch)
        track.begin_epoch(epoch)  # every elastic callback calls it: once counts
        for batch in range(steps):
            track.end_batch(batch)
            track.end_batch(batch)
            seen.append((track.state.epoch, track.state.batch))
            if model.stop_training or (stop_at and (epoch, batch) == stop_at):
                break
        track.end_epoch(epoch)
        track.end_epoch(epoch)
        if stop_at and (epoch, batch) == stop_at:
            break
    return seen


@pytest.mark.parametrize("style", ["epochs-minus-state", "initial-epoch"])
def test_counters_whatever_fit_is_given(style):
    state = ObjectState(epoch=2, batch=0)
    track = state.progress
    track.track_batch = track.track_epoch = True
    if style == "initial-epoch":
        seen = _fit(track, _Model(), 4, 2, 3)
    else:
        seen = _fit(track, _Model(), 4 - state.epoch, 0, 3)
    # The counters move to the next epoch with an epoch's last batch.
    assert seen == [(2, 1), (2, 2), (3, 0), (3, 1), (3, 2), (4, 0)]
    assert (state.epoch, state.batch) == (4, 0)


def test_resumed_epoch_runs_the_steps_left_at_a_new_size():
    """A commit at 2 ranks after 2 of 6 steps: at 1 rank (12 steps a
    epoch) the epoch goes on for the 8 steps left, then fit goes on."""
    state = ObjectState(epoch=1, batch=2)
    track = state.progress
    track.track_batch = track.track_epoch = True
    track.restore({"steps": 6, "done": 2, "samples": None}, size=2)
    model = _Model()
    seen = _fit(track, model, 3, 1, 12)
    assert seen[0] == (1, 5) and seen[6] == (1, 11) and seen[7] == (2, 0)
    assert seen[8] == (2, 1) and len(seen) == 8 + 12
    assert not model.stop_training and (state.epoch, state.batch) == (3, 0)


def test_commit_after_the_last_batch_resumes_at_the_next_epoch():
    state = ObjectState(epoch=0, batch=6)
    track = state.progress
    track.track_batch = track.track_epoch = True
    track.restore({"steps": 6, "done": 6, "samples": None}, size=2)
    assert (state.epoch, state.batch) == (1, 0) and track.resume is None


def test_elastic_data_resharding_covers_each_sample_once(monkeypatch):
    state = ObjectState(epoch=0, batch=0)
    data = ElasticData((np.arange(50), np.arange(50) * 2), batch_size=4, state=state,
                       shuffle_seed=3)
    order = data.order(0)
    ids = []
    # 2 global batches at 3 ranks (24 samples), then the rest at 2 ranks.
    for rank in range(3):
        batches = data._generate(0, 0, rank, 3, 12)
        for _ in range(2):
            x, y = next(batches)
            np.testing.assert_array_equal(y, x * 2)
            ids.extend(x.tolist())
    left = []
    for rank in range(2):
        batches = data._generate(0, 24, rank, 2, 8)
        for _ in range(4):  # 26 samples left: 3 global batches of 8 and one of 2
            left.extend(next(batches)[0].tolist())
    assert sorted(ids + left) == list(range(50))
    assert sorted(left) == sorted(order[24:].tolist())
    monkeypatch.setattr(progress.context, "get", lambda: types.SimpleNamespace(size=2, rank=0))
    assert data.remaining_steps(24) == 4 and data.steps_per_epoch() == 7


def test_elastic_data_checks_its_arguments():
    state = ObjectState(epoch=0)
    with pytest.raises(ValueError, match="batch_size"):
        ElasticData(np.arange(4), batch_size=0, state=state)
    with pytest.raises(ValueError, match="same first dimension"):
        ElasticData((np.arange(4), np.arange(5)), batch_size=2, state=state)


def test_kdrun_elastic_options():
    options = parse_args(["-np", "2", "--max-restarts", "5", "--max-np", "4", "python", "t.py"])
    assert options.elastic.max_restarts == 5
    assert (options.elastic.min_np, options.elastic.max_np) == (2, 4)
    assert parse_args(["-np", "2", "--max-restarts", "0", "x"]).elastic.max_restarts == 0
    assert parse_args(["-np", "2", "x"]).elastic is None
    with pytest.raises(UsageError, match="--min-np"):
        parse_args(["-np", "2", "--min-np", "3", "x"])
    with pytest.raises(UsageError, match="executable"):
        parse_args(["-np", "2", "--host-discovery-script", "/nonexistent", "x"])
    with pytest.raises(UsageError, match="whole number"):
        parse_args(["-np", "2", "--max-restarts", "-1", "x"])


def test_placement_and_trim():
    hosts = (("a", 2), ("b", 2))
    assert placement(hosts, 3) == {0: "a", 1: "a", 2: "b"}
    assert trim(hosts, 3) == (("a", 2), ("b", 1))


def test_state_on_remote_hosts_is_removed_through_mpiexec():
    options = parse_args(["-np", "2", "--max-restarts", "1", "-H", "a:1,b:1", "x"])
    command = cleanup_command(options, ["a", "b"], "/dev/shm/keras_dist-elastic-j")
    assert command[1:7] == ["-hosts", "a,b", "-ppn", "1", "-n", "2"]
    assert "shutil.rmtree('/dev/shm/keras_dist-elastic-j', True)" in command[-1]
    assert cleanup_command(options, [], "/x") is None


def test_a_silent_remote_host_is_lost_after_its_grace(monkeypatch):
    from keras_dist.launcher import elastic as launcher_elastic

    clock = [1000.0]
    monkeypatch.setattr(launcher_elastic.time, "monotonic", lambda: clock[0])
    options = parse_args(["-np", "4", "--min-np", "2", "-H", "a:2,b:2", "x"])
    watch = launcher_elastic.Watch(launcher_elastic.Discovery(options), options.hosts, 4)
    # Before a host's first word it gets STARTUP_SILENCE_SECONDS.
    clock[0] += launcher_elastic.SILENCE_SECONDS + 1
    assert watch.tick(None) is None
    for rank in range(4):
        watch.record({"event": "alive", "rank": rank})
    clock[0] += launcher_elastic.SILENCE_SECONDS / 2
    watch.record({"event": "alive", "rank": 1})  # host a keeps talking, b falls silent
    clock[0] += launcher_elastic.SILENCE_SECONDS / 2 + 1
    reason = watch.tick(None)
    assert reason == (f"no word from host b (ranks 2-3) for "
                      f"{launcher_elastic.SILENCE_SECONDS:g} s: lost"), reason
    assert watch.silent == ["b"]
    # A host that never said a word is lost once the start-up grace is over.
    late = launcher_elastic.Watch(launcher_elastic.Discovery(options), options.hosts, 4)
    late.record({"event": "alive", "rank": 0})
    clock[0] += launcher_elastic.STARTUP_SILENCE_SECONDS + 1
    late.record({"event": "alive", "rank": 0})
    assert "host b" in (late.tick(None) or "")
