"""Shared pytest set-up: the repository root is importable, so tests can
``from tests._mp import run_job`` (see tests/_mp.py) whether or not the
package is installed, and whatever directory pytest was started from."""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
