"""The TensorFlow API as Horovod's users call it, at 1, 2 and 3 ranks, under kdrun.

Gradients of the collectives (eager, ``tf.function``, TF1 graph), the TF error
classes, ``average=``, integer scaling, ``IndexedSlices``, ``broadcast_`` and
``broadcast_global_variables``, the order of a TF1 graph's collectives,
the capability queries. The worker checks every result on every rank
against references it computes itself; here we require every rank to pass
every test.
"""

import pytest

from tests.multiprocess._shared_jobs import TEST_TIMEOUT, suite_output

TESTS = ["test_gradients_eager_function_and_graph", "test_model_parallel_tape_in_function",
         "test_second_order_gradient",
         "test_legacy_average_flag", "test_integer_and_half_scaling", "test_indexed_slices",
         "test_broadcast_in_place", "test_broadcast_global_variables",
         "test_bools_and_process_set_none", "test_graph_collectives_run_in_build_order",
         "test_queries", "test_argument_errors_are_tf_errors",
         "test_mismatches_are_failed_preconditions"]


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("np_", [1, 2, 3])
def test_tensorflow_api_on_every_rank(np_, tf_job):
    # workers/tf_api.py in the shared TensorFlow job of np_ ranks
    # (tests/multiprocess/_shared_jobs.py); at 3 ranks on two pretend machines
    # (2 + 1 ranks): the hierarchical transport, and a job that is not homogeneous.
    result = tf_job(np_)
    for rank in range(np_):
        output = suite_output(result, "tf_api", rank)
        for test in TESTS:
            assert f"SUITE {test} passed rank={rank}" in output, result.describe()
        assert f"TF API OK rank={rank} size={np_}" in output, result.describe()
