"""Shared pytest set-up.

The repository root is importable, so tests can ``from tests._mp import
run_job`` (see tests/_mp.py) whether or not the package is installed, and
whatever directory pytest was started from.

The tests of ``SYSTEM_FOLDERS`` carry the ``system`` mark: jobs on emulated
clusters (Ray, Spark, Slurm, Kubernetes pods, hosts in network namespaces,
shaped links), strangers attacking a job's ports, elastic relaunches. The
README's test command leaves them out, with the tests marked ``slow``
(``-m "not system and not slow"``); CI runs them next
(``pytest -m "system or slow"``).
"""

import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent
_ROOT = str(_TESTS.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

SYSTEM_FOLDERS = ("cluster", "elastic", "faults")


def pytest_collection_modifyitems(items):
    for item in items:
        if Path(item.path).resolve().relative_to(_TESTS).parts[0] in SYSTEM_FOLDERS:
            item.add_marker(pytest.mark.system)
