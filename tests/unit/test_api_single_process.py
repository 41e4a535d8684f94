"""The public API in one process (size 1, the local transport)."""

import os
import subprocess
import sys

import numpy as np
import pytest

import keras_dist as kd
from tests.multiprocess.workers import bad_inputs

BAD_CALLS = bad_inputs.CASES


def test_calls_before_init_say_to_call_init():
    code = ("import keras_dist as kd, numpy as np\n"
            "for call in (kd.size, kd.rank, lambda: kd.allreduce(np.ones(2))):\n"
            "    try:\n        call()\n    except kd.NotInitializedError as e:\n"
            "        assert 'keras_dist.init()' in str(e), e\n"
            "    else:\n        raise SystemExit('no error before init')\n"
            "assert not kd.is_initialized()\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                   env={**os.environ, "PYTHONPATH": os.getcwd()})


@pytest.fixture(scope="module", autouse=True)
def group():
    kd.init()
    kd.init()  # idempotent
    yield
    kd.shutdown()


def test_topology_of_one_process():
    assert kd.is_initialized()
    assert (kd.size(), kd.rank(), kd.local_size(), kd.local_rank(), kd.cross_size(),
            kd.cross_rank()) == (1, 0, 1, 0, 1, 0)


def test_size_one_collectives_are_the_identity():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    assert kd.allreduce(x) is x  # no copy at size 1
    np.testing.assert_array_equal(kd.allreduce(x, op=kd.Sum), x)
    np.testing.assert_allclose(kd.allreduce(x, prescale_factor=2.0, postscale_factor=0.25),
                               x * 0.5, rtol=1e-6)
    np.testing.assert_array_equal(kd.broadcast(x, 0), x)
    np.testing.assert_array_equal(kd.allgather(x), x)
    assert kd.allgather(np.float32(2.5)).shape == (1,)
    assert kd.broadcast_object({"a": 1}) == {"a": 1}
    assert kd.allgather_object(5) == [5]
    assert kd.grouped_allreduce([]) == []
    kd.barrier()


def test_traced_size_one_allreduces_and_allgathers_add_no_host_call():
    import tensorflow as tf

    from keras_dist.tensor import ops

    rng = np.random.default_rng(2)
    x = tf.constant(rng.standard_normal((3, 4)).astype(np.float32))
    scalar = tf.constant(np.int64(7))
    ids = tf.constant(rng.integers(0, 9, 5))

    @tf.function
    def step(x, scalar, ids):
        values, indices = ops.gather_rows(x, ids, name="rows")
        return (kd.grouped_allreduce([x])[0], kd.allgather(x), kd.allgather(scalar), values,
                indices)

    reduced, gathered, gathered_scalar, values, indices = step(x, scalar, ids)
    for got, want in ((reduced, x), (gathered, x), (values, x), (indices, ids)):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert gathered_scalar.shape == (1,) and gathered_scalar.numpy()[0] == 7
    types = {op.type for op in step.get_concrete_function(x, scalar, ids).graph.get_operations()}
    assert not any(t.startswith("PyFunc") or t.startswith("KerasDist") for t in types), types


def test_bad_arguments_are_explained():
    with pytest.raises(ValueError, match=r"root_rank.*Received: root_rank=1 \(size=1\)"):
        kd.broadcast(np.ones(2), root_rank=1)
    with pytest.raises(TypeError, match="complex64"):
        kd.allreduce(np.ones(2, np.complex64))
    with pytest.raises(ValueError, match="op"):
        kd.allreduce(np.ones(2), op="average")
    with pytest.raises(ValueError, match=r"not both\. Received: op=.*SUM.*, average=True"):
        kd.allreduce(np.ones(2), op=kd.Sum, average=True)
    with pytest.raises(TypeError, match="list or tuple"):
        kd.grouped_allreduce(np.ones(2))


def test_timeline_writes_valid_json(tmp_path):
    import json

    path = tmp_path / "timeline.json"
    kd.start_timeline(str(path))
    kd.allreduce(np.ones(3), name="grads")
    kd.stop_timeline()  # one rank: the trace is written at once, no part is left
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {"rank 0"}
    assert os.listdir(tmp_path) == ["timeline.json"]


@pytest.mark.parametrize("case", BAD_CALLS, ids=[case.label for case in BAD_CALLS])
def test_invalid_calls_raise_at_one_rank_what_they_raise_at_several(case):
    # The same cases run on every rank at 2 and 3 ranks in workers/collectives.py.
    assert bad_inputs.raised(case, kd, kd.size()) is None
