"""Property-based tests of the public API at 1, 2 and 3 ranks (hypothesis)."""

import pytest

from tests._mp import run_job


@pytest.mark.timeout(200)
@pytest.mark.parametrize("np_", [1, 2, 3])
def test_public_api_properties(np_):
    result = run_job(["python", "tests/multiprocess/workers/properties.py"], np=np_, timeout=170,
                     env={"KERAS_DIST_TIMEOUT_SECONDS": "60"})
    result.check()
    for rank in range(np_):
        assert f"PROPERTIES OK rank={rank} size={np_}" in result.output(rank), result.describe()
