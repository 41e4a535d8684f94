"""The one-call native path of ``kd.allreduce`` / ``broadcast`` / ``allgather`` on numpy
arrays: taken on a transport with a native engine (shm), not taken on one without
(MPI) nor while a timeline records (the general path records the call).

``_native.dispatch_served()`` counts the calls the native entries served; the
results are checked on every path."""

import sys
import textwrap

import pytest

from tests._mp import run_job

WORKER = textwrap.dedent("""
    import os

    import numpy as np

    import keras_dist as kd
    from keras_dist import _native

    kd.init()
    size = kd.size()
    x = np.arange(6, dtype=np.float32) + kd.rank()
    expected_sum = sum(np.arange(6, dtype=np.float32) + r for r in range(size))


    def served_by_three_calls():
        before = _native.dispatch_served()
        np.testing.assert_array_equal(kd.allreduce(x, op=kd.Sum), expected_sum)
        np.testing.assert_array_equal(kd.broadcast(x, root_rank=0), np.arange(6, dtype=np.float32))
        np.testing.assert_array_equal(
            kd.allgather(x), np.concatenate([np.arange(6, dtype=np.float32) + r
                                             for r in range(size)]))
        return _native.dispatch_served() - before


    plain = served_by_three_calls()
    kd.start_timeline(os.path.join(os.environ["TIMELINE_DIR"], "trace.json"))
    recording = served_by_three_calls()
    kd.stop_timeline(summary=False)
    after = served_by_three_calls()
    print(f"SERVED rank={kd.rank()} plain={plain} recording={recording} after={after}",
          flush=True)
    kd.shutdown()
""")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("transport, served", [("shm", 3), ("mpi", 0)])
def test_the_one_call_path_is_taken_exactly_on_a_transport_with_an_engine(
        transport, served, tmp_path):
    result = run_job([sys.executable, "-c", WORKER], np=2, timeout=180,
                     env={"KERAS_DIST_CPU_OPERATIONS": transport, "OMP_NUM_THREADS": "1",
                          "TIMELINE_DIR": str(tmp_path)})
    result.check()
    for rank in range(2):
        assert (f"SERVED rank={rank} plain={served} recording=0 after={served}"
                in result.output(rank)), result.describe()
