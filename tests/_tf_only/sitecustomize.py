"""Makes the top-level packages named in ``KERAS_DIST_TEST_HIDE`` (comma
separated) impossible to import, as if they were not installed.

``tests/_mp.py`` puts this directory on ``PYTHONPATH`` for jobs on the
TensorFlow backend, so their ranks start as on a TensorFlow-only install:
with JAX and matplotlib installed (the test extra has them for other tests),
``import tensorflow`` imports JAX (TensorFlow Lite's converter looks for it)
and Keras imports ``matplotlib.pyplot``, 1.4 s of every rank's start-up.

Every finder of ``sys.meta_path`` is wrapped so that it finds no hidden
module: an import raises ``ModuleNotFoundError`` and
``importlib.util.find_spec`` answers ``None``, as for a package that is not
installed (``torch._dynamo`` asks for the specs of TensorFlow and JAX).
"""

import os
import sys


class _Hiding:
    """``finder``, except that it finds nothing named in ``names``."""

    def __init__(self, finder, names):
        self.finder, self.names = finder, names

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            return None
        find = getattr(self.finder, "find_spec", None)
        return None if find is None else find(name, path, target)

    def __getattr__(self, name):  # invalidate_caches, find_distributions, ...
        return getattr(self.finder, name)


_names = frozenset(n.strip() for n in os.environ.get("KERAS_DIST_TEST_HIDE", "").split(",")
                   if n.strip())
if _names:
    sys.meta_path[:] = [_Hiding(finder, _names) for finder in sys.meta_path]
