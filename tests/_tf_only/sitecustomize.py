"""Makes the top-level packages named in ``KERAS_DIST_TEST_HIDE`` (comma
separated) impossible to import, as if they were not installed.

``tests/_mp.py`` puts this directory on ``PYTHONPATH`` for jobs on the
TensorFlow backend, so their ranks start as on a TensorFlow-only install:
with JAX and matplotlib installed (the test extra has them for other tests),
``import tensorflow`` imports JAX (TensorFlow Lite's converter looks for it)
and Keras imports ``matplotlib.pyplot``, 1.4 s of every rank's start-up.
"""

import os
import sys


class _Hidden:
    def __init__(self, names):
        self.names = frozenset(names)

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the tests)",
                                      name=name)
        return None


_names = [n.strip() for n in os.environ.get("KERAS_DIST_TEST_HIDE", "").split(",") if n.strip()]
if _names:
    sys.meta_path.insert(0, _Hidden(_names))
