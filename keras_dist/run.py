"""``python -m keras_dist.run``: the same as ``kdrun`` (``keras_dist.launcher.cli``)."""

import sys

from keras_dist.launcher.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
