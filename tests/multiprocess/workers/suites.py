"""Runs several Horovod-API suites of this folder one after another in one job.

``python horovod_suites.py tape.py keras_api.py ...``: each suite runs as its
own ``__main__`` (its checks print their markers as when run alone), with
keras_dist shut down in between, so that each suite's ``kd.init`` takes its
own arguments. One start-up of Python, TensorFlow, Keras and MPI serves them
all. A suite whose checks failed does not stop the next suite; the job then
exits with status 1.
"""

import os
import runpy
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)  # as each suite sets them
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras_dist as kd  # noqa: E402

HERE = Path(__file__).parent

if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(f"usage: {sys.argv[0]} SUITE.py [SUITE.py ...]")
    failed = []
    for suite in sys.argv[1:]:
        try:
            runpy.run_path(str(HERE / suite), run_name="__main__")
        except SystemExit as stop:  # a suite's failed checks (workers/_checks.py)
            if stop.code not in (None, 0):
                failed.append(suite)
        kd.shutdown()
    if failed:
        print(f"SUITES FAILED: {', '.join(failed)}", flush=True)
        sys.exit(1)
