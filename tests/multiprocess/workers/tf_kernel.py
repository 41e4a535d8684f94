"""A traced TF step's grouped allreduce and allgathers through keras_dist's
ops (``tf_kernel``).

Every rank regenerates every rank's data (seeded by rank and step), so each
result is checked against a float64 reference built here. Prints
"TFOP <check> passed rank=R" per check.
"""

import glob
import json
import os
import tempfile

import numpy as np
import tensorflow as tf

import keras_dist as kd
from tests.multiprocess.workers._checks import run_checks

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
kd.init()
RANK, SIZE = kd.rank(), kd.size()
# float32 tensors, one larger than the shm buffer (the job runs with a small
# slot), float64, float16, int32, a scalar and an empty tensor.
SPECS = [((17, 9), np.float32), ((300_000,), np.float32), ((5,), np.float64),
         ((33,), np.float16), ((4, 3), np.int32), ((), np.float32), ((0,), np.float32)]


def data(rank, step):
    rng = np.random.default_rng([rank, step, 3])
    return [(rng.standard_normal(shape) * 10).astype(dtype) if np.dtype(dtype).kind == "f"
            else rng.integers(-50, 50, shape).astype(dtype) for shape, dtype in SPECS]


def reference(step, op):
    summed = [sum(data(r, step)[i].astype(np.float64) for r in range(SIZE))
              for i in range(len(SPECS))]
    if op is kd.Average:
        return [s / SIZE for s in summed]
    return summed


def op_types(function, values):
    return [op.type for op in function.get_concrete_function(values).graph.get_operations()]


def tolerance(dtype):
    return {np.float16: 2e-2, np.float32: 1e-5}.get(np.dtype(dtype).type, 1e-12)


def check(got, want, label):
    for (shape, dtype), g, w in zip(SPECS, got, want):
        g = g.numpy()
        assert g.shape == shape and g.dtype == dtype, (label, g.shape, g.dtype, shape, dtype)
        if np.dtype(dtype).kind == "i":
            w = np.floor(w) if label.endswith("average") else w  # integer average rounds down
            assert np.array_equal(g, w.astype(dtype)), (label, g, w)
        else:
            assert np.allclose(g, w, rtol=tolerance(dtype), atol=tolerance(dtype)), (label,)


def test_grouped_allreduce_matches_the_float64_reference():
    from keras_dist.tensor import ops

    fused = []  # buckets the op's fallback reduced: none (one is larger than the shm
    # buffer, 1.2 MB against 512 KiB, and goes in windows)
    plain = ops._reduce_fused
    ops._reduce_fused = lambda *args: (fused.append(args[4]), plain(*args))
    for op, name in ((kd.Sum, "sum"), (kd.Average, "average")):
        @tf.function
        def step(xs, op=op):
            return kd.grouped_allreduce(xs, op=op)

        values = [tf.constant(a) for a in data(RANK, 0)]
        types = op_types(step, values)
        assert types.count("KerasDistAllreduce") == 1, types
        assert not any(t.startswith("PyFunc") for t in types), types
        for k in range(3):
            check(step([tf.constant(a) for a in data(RANK, k)]), reference(k, op), name)
    ops._reduce_fused = plain
    assert not fused, fused


def test_the_numpy_path_gives_the_same_bits():
    values = [tf.constant(a) for a in data(RANK, 7)]
    previous = os.environ.get("KERAS_DIST_TF_OP")
    results = {}
    for setting in ("1", "0"):
        os.environ["KERAS_DIST_TF_OP"] = setting  # read when the step is traced

        @tf.function
        def step(xs):
            return kd.grouped_allreduce(xs, op=kd.Average)

        types = op_types(step, values)
        assert ("KerasDistAllreduce" in types) == (setting == "1"), (setting, types)
        results[setting] = [r.numpy() for r in step(values)]
    if previous is None:
        del os.environ["KERAS_DIST_TF_OP"]
    else:
        os.environ["KERAS_DIST_TF_OP"] = previous
    for a, b in zip(results["1"], results["0"]):
        assert a.tobytes() == b.tobytes()


def test_fresh_inputs_are_reduced_in_place_and_inputs_read_elsewhere_are_kept():
    from keras_dist.tensor.tf import kernel as tf_kernel

    @tf.function
    def fresh(xs):
        return kd.grouped_allreduce([x + x for x in xs], op=kd.Average)

    @tf.function
    def shared(xs):
        doubled = [x + x for x in xs]
        return kd.grouped_allreduce(doubled, op=kd.Average), doubled

    def doubled_reference(step):
        return [2 * w for w in reference(step, kd.Average)]

    before = tf_kernel.forwarded_outputs()
    for k in range(3):
        check(fresh([tf.constant(a) for a in data(RANK, 20 + k)]), doubled_reference(20 + k),
              "in place average")
    nonempty = sum(1 for shape, _ in SPECS if np.prod(shape, dtype=int) > 0)
    assert tf_kernel.forwarded_outputs() - before == 3 * nonempty, (
        tf_kernel.forwarded_outputs() - before, nonempty)
    # The step reads its inputs after the op: the op must leave them as they were.
    before = tf_kernel.forwarded_outputs()
    for k in range(3):
        mine = data(RANK, 30 + k)
        reduced, inputs = shared([tf.constant(a) for a in mine])
        check(reduced, doubled_reference(30 + k), "kept inputs average")
        for a, kept in zip(mine, inputs):
            assert np.array_equal(kept.numpy(), a + a), "an input read after the op changed"
    assert tf_kernel.forwarded_outputs() == before


FLOATS = [i for i, (_, dtype) in enumerate(SPECS) if np.dtype(dtype).kind == "f"]
PRESCALE, POSTSCALE = 0.25, 3.0


def test_scaled_allreduces_run_in_the_op_with_the_numpy_paths_bits():
    """prescale_factor and postscale_factor on floating-point tensors: the op
    scales (against float64, and bit for bit the numpy path's result); its
    inputs read after it are kept; an integer tensor in the call sends the
    whole call down the numpy path, which scales it as numpy truncates."""
    def scaled(op):
        @tf.function
        def step(xs):
            reduced = kd.grouped_allreduce(xs, op=op, prescale_factor=PRESCALE,
                                           postscale_factor=POSTSCALE)
            return reduced, xs
        return step

    previous = os.environ.get("KERAS_DIST_TF_OP")
    for op, name in ((kd.Sum, "scaled sum"), (kd.Average, "scaled average")):
        results = {}
        for setting in ("1", "0"):
            os.environ["KERAS_DIST_TF_OP"] = setting  # read when the step is traced
            step = scaled(op)
            mine = [data(RANK, 40)[i] for i in FLOATS]
            types = op_types(step, [tf.constant(a) for a in mine])
            assert (types.count("KerasDistAllreduce") == 1) == (setting == "1"), (setting, types)
            reduced, kept = step([tf.constant(a) for a in mine])
            want = reference(40, op)
            for i, g, k, a in zip(FLOATS, reduced, kept, mine):
                dtype = SPECS[i][1]
                w = want[i] * PRESCALE * POSTSCALE
                assert g.dtype == dtype and g.shape == SPECS[i][0], (name, i, g.dtype, g.shape)
                assert np.allclose(g.numpy(), w, rtol=tolerance(dtype), atol=tolerance(dtype)), (
                    name, setting, i, g.numpy(), w)
                assert np.array_equal(k.numpy(), a), f"{name}: an input read after the op changed"
            results[setting] = [g.numpy() for g in reduced]
        for a, b in zip(results["1"], results["0"]):
            assert a.tobytes() == b.tobytes(), name
    if previous is None:
        del os.environ["KERAS_DIST_TF_OP"]
    else:
        os.environ["KERAS_DIST_TF_OP"] = previous
    # With the int32 tensor in the call: the numpy path, every tensor scaled.
    step = scaled(kd.Sum)
    types = op_types(step, [tf.constant(a) for a in data(RANK, 41)])
    assert "KerasDistAllreduce" not in types, types
    reduced, _ = step([tf.constant(a) for a in data(RANK, 41)])
    ints = [sum((data(r, 41)[i].astype(np.float64) * PRESCALE).astype(SPECS[i][1])
                for r in range(SIZE)) for i in range(len(SPECS))]
    for i, (g, w) in enumerate(zip(reduced, reference(41, kd.Sum))):
        if i in FLOATS:
            assert np.allclose(g.numpy(), w * PRESCALE * POSTSCALE, rtol=tolerance(SPECS[i][1]),
                               atol=tolerance(SPECS[i][1])), ("mixed", i)
        else:
            assert np.array_equal(g.numpy(), (ints[i] * POSTSCALE).astype(SPECS[i][1])), (
                "mixed", i, g.numpy(), ints[i])


def test_mismatched_shapes_fail_on_every_rank_and_the_job_goes_on():
    @tf.function
    def step(xs):
        return kd.grouped_allreduce(xs, op=kd.Sum)

    mine = tf.constant(np.ones(3 + RANK, np.float32))
    try:
        step([mine])
    except tf.errors.FailedPreconditionError as error:
        assert "CollectiveMismatchError" in str(error), str(error)
    else:
        raise AssertionError("a mismatch did not fail the step")
    check(step.python_function([tf.constant(a) for a in data(RANK, 1)]), reference(1, kd.Sum),
          "after the mismatch, sum")


def test_a_timeline_records_the_op_with_its_waits():
    @tf.function
    def step(xs):
        return kd.grouped_allreduce(xs, op=kd.Average)

    events = timeline_events(lambda: step([tf.constant(a) for a in data(RANK, 2)]))
    names = [e["name"] for e in events if e.get("ph") == "X"]
    assert names.count("allreduce") == 1, names
    assert "wait for peers" in names and "move data" in names, names


def timeline_events(run):
    """The events this rank's timeline recorded while ``run()`` ran."""
    directory = tempfile.mkdtemp(prefix=f"kd-tfop-{RANK}-")
    kd.start_timeline(os.path.join(directory, "t.json"))
    try:
        run()
    finally:
        kd.stop_timeline(summary=False)
    (part,) = glob.glob(os.path.join(directory, "t.json.rank*"))
    with open(part) as lines:
        events = [json.loads(line) for line in lines]
    for leftover in glob.glob(os.path.join(directory, "*")):
        os.unlink(leftover)
    os.rmdir(directory)
    return events


# Allgathers: per spec (shape past the first dimension, dtype), rank r's rows
# are base + r * 3 + step % 2; one spec's data is larger than the shm buffer.
GATHER_SPECS = [((4,), np.float32, 1), ((), np.int64, 2), ((2, 3), np.float16, 0),
                ((), np.uint8, 5), ((50_000,), np.float32, 2), ((7,), np.float64, 0)]


def gathered_data(rank, step):
    rng = np.random.default_rng([rank, step, 11])
    out = []
    for rest, dtype, base in GATHER_SPECS:
        shape = (base + rank * 3 + step % 2, *rest)
        values = (rng.standard_normal(shape) * 100 if np.dtype(dtype).kind == "f"
                  else rng.integers(0, 200, shape))
        out.append(values.astype(dtype))
    return out


def gathered_reference(step):
    return [np.concatenate([gathered_data(r, step)[i] for r in range(SIZE)])
            for i in range(len(GATHER_SPECS))]


def gather_step():
    from keras_dist.tensor import ops

    @tf.function
    def step(xs):
        # Each alone (its own op), and the first two as a sparse gradient's
        # values and indices (one op).
        alone = [kd.allgather(x, name=f"gather {i}") for i, x in enumerate(xs)]
        values, indices = ops.gather_rows(xs[0], xs[1], name="rows")
        return alone, values, indices

    return step


def test_allgathers_match_every_ranks_rows_and_the_numpy_paths_bits():
    previous = os.environ.get("KERAS_DIST_TF_OP")
    results = {}
    for setting in ("1", "0"):
        os.environ["KERAS_DIST_TF_OP"] = setting  # read when the step is traced
        step = gather_step()
        for k in range(4):  # row counts change from step to step
            alone, values, indices = step([tf.constant(a) for a in gathered_data(RANK, k)])
            want = gathered_reference(k)
            for got, w in zip(alone, want):
                assert got.dtype == w.dtype and got.shape == w.shape, (got.shape, w.shape)
                assert got.numpy().tobytes() == w.tobytes(), "a gather's bytes differ"
            assert np.array_equal(values.numpy(), want[0]), "the values' rows differ"
            assert np.array_equal(indices.numpy(), want[1]), "the indices differ"
        types = step.get_concrete_function(
            [tf.TensorSpec([None, *rest], dtype) for rest, dtype, _ in GATHER_SPECS]
        ).graph.get_operations()
        types = [op.type for op in types]
        if setting == "1":
            # One op per gather alone and one for the values and indices together.
            assert types.count("KerasDistAllgather") == len(GATHER_SPECS) + 1, types
            assert not any("PyFunc" in t for t in types), types
        else:
            assert "KerasDistAllgather" not in types, types
        results[setting] = [a.numpy() for a in alone]
    if previous is None:
        del os.environ["KERAS_DIST_TF_OP"]
    else:
        os.environ["KERAS_DIST_TF_OP"] = previous
    for a, b in zip(results["1"], results["0"]):
        assert a.shape == b.shape and a.tobytes() == b.tobytes()


def test_an_allgather_of_mismatched_shapes_fails_on_every_rank_and_the_job_goes_on():
    @tf.function
    def step(x):
        return kd.allgather(x, name="mismatched")

    try:
        step(tf.constant(np.ones((2, 3 + RANK), np.float32)))
    except tf.errors.FailedPreconditionError as error:
        assert "CollectiveMismatchError" in str(error), str(error)
        assert "rank 1: shape=(2, 4)" in str(error), str(error)
    else:
        raise AssertionError("a mismatch did not fail the step")
    mine = gathered_data(RANK, 3)[0]
    got = step(tf.constant(mine)).numpy()
    assert np.array_equal(got, gathered_reference(3)[0])


def test_a_timeline_records_each_allgather_with_its_bytes():
    step = gather_step()
    events = timeline_events(lambda: step([tf.constant(a) for a in gathered_data(RANK, 0)]))
    gathers = [e for e in events if e.get("ph") == "X" and e["name"] == "allgather"]
    assert len(gathers) == len(GATHER_SPECS) + 2, gathers
    want = gathered_reference(0)
    by_name = {e["args"]["name"]: e["args"]["bytes"] for e in gathers}
    for i, w in enumerate(want):
        assert by_name[f"gather {i}"] == w.nbytes, (i, by_name)
    assert by_name["rows values"] == want[0].nbytes, by_name
    assert by_name["rows indices"] == want[1].nbytes, by_name


# The agreement after each check (an allgather) also keeps the ranks in step between checks.
run_checks([globals()[name] for name in sorted(globals()) if name.startswith("test_")],
           rank=RANK, passed="TFOP {name} passed rank={rank}", agree=kd.allgather_object)
