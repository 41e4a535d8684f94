"""The TensorFlow API as Horovod's users call it, at 1, 2 and 3 ranks, under kdrun.

Gradients of the collectives (eager, ``tf.function``, TF1 graph), the TF error
classes, ``average=``, integer scaling, ``IndexedSlices``, ``broadcast_`` and
``broadcast_global_variables``, the order of a TF1 graph's collectives,
the capability queries. The worker checks every result on every rank
against references it computes itself; here we require every rank to pass
every test.
"""

import pytest

from tests._mp import run_job

WORKER = "tests/multiprocess/workers/tf_api.py"
TF_QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1",
            "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}
TESTS = ["test_gradients_eager_function_and_graph", "test_model_parallel_tape_in_function",
         "test_second_order_gradient",
         "test_legacy_average_flag", "test_integer_and_half_scaling", "test_indexed_slices",
         "test_broadcast_in_place", "test_broadcast_global_variables",
         "test_bools_and_process_set_none", "test_graph_collectives_run_in_build_order",
         "test_queries", "test_argument_errors_are_tf_errors",
         "test_mismatches_are_failed_preconditions"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("np_", [1, 2, 3])
def test_tensorflow_api_on_every_rank(np_):
    # At 3 ranks, two virtual machines (2 + 1 ranks): the hierarchical
    # transport, and a job that is not homogeneous.
    per_node = {"KERAS_DIST_RANKS_PER_NODE": "2"} if np_ == 3 else {}
    result = run_job(WORKER, np=np_, timeout=260,
                     env={**TF_QUIET, **per_node, "KERAS_DIST_TIMEOUT_SECONDS": "60"})
    result.check()
    for rank in range(np_):
        output = result.output(rank)
        for test in TESTS:
            assert f"SUITE {test} passed rank={rank}" in output, result.describe()
        assert f"TF API OK rank={rank} size={np_}" in output, result.describe()
