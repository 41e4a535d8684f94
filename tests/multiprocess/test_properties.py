"""Property-based tests of the public API at 1, 2 and 3 ranks (hypothesis)."""

import pytest

from tests.multiprocess._shared_jobs import TEST_TIMEOUT, suite_output


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("np_", [1, 2, 3])
def test_public_api_properties(np_, tf_job):
    # In the shared job of np_ ranks (tests/multiprocess/_shared_jobs.py).
    result = tf_job(np_)
    for rank in range(np_):
        output = suite_output(result, "properties", rank)
        assert f"PROPERTIES OK rank={rank} size={np_}" in output, result.describe()
