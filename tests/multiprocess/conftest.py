"""Fixtures of the multi-rank tests."""

import pytest

from tests._mp import JobResult
from tests.multiprocess._shared_jobs import run_tf_job


@pytest.fixture(scope="session")
def tf_job(request):
    """``tf_job(np_)``: the result of the shared TensorFlow job of ``np_`` ranks
    (tests/multiprocess/_shared_jobs.py), run once per session, with the
    workers of the test files this session runs."""
    tests = {item.path.stem for item in request.session.items}
    results: dict[int, JobResult] = {}

    def result(np_: int) -> JobResult:
        if np_ not in results:
            results[np_] = run_tf_job(np_, tests)
        return results[np_]

    return result
