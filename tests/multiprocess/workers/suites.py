"""Runs several workers of ``tests/multiprocess`` one after another in one job.

``python suites.py SPEC [SPEC ...]``, each ``SPEC`` a JSON object::

    {"label": "join-mpi", "path": "workers/join.py", "args": [],
     "env": {"KERAS_DIST_CPU_OPERATIONS": "mpi"}}

Each worker (``path``, relative to ``tests/multiprocess``, or absolute) runs as its own
``__main__`` with ``sys.argv = [path, *args]`` and ``env`` added to the
environment for its run only (settings are read by each ``kd.init``), its
checks printing their markers as when run alone, with keras_dist shut down in
between. One start-up of Python, TensorFlow, Keras and MPI serves them all.

Every rank prints ``SUITE <label> begins rank=R`` before a worker and
``SUITE <label> ends rank=R: ok`` (or ``: failed``) after it, so a test reads
one worker's output alone (``tests/multiprocess/conftest.py``'s
``suite_output``). A worker whose checks failed does not stop the next one;
the job then exits with status 1.
"""

import json
import os
import runpy
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)  # as each worker sets them
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras_dist as kd  # noqa: E402

HERE = Path(__file__).resolve().parent.parent


def run_suite(spec: dict, rank: str) -> bool:
    """Runs one worker as ``__main__``; True when it ended without an error."""
    label = spec["label"]
    saved = {name: os.environ.get(name) for name in spec.get("env", {})}
    os.environ.update(spec.get("env", {}))
    sys.argv = [spec["path"], *spec.get("args", [])]
    print(f"SUITE {label} begins rank={rank}", flush=True)
    ok = True
    started = time.process_time(), time.perf_counter()
    try:
        runpy.run_path(str(HERE / spec["path"]), run_name="__main__")
    except SystemExit as stop:  # a worker's failed checks (workers/_checks.py)
        ok = stop.code in (None, 0)
    finally:
        kd.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    # What each worker costs, for whoever trims the job (never asserted on).
    print(f"SUITE {label} took rank={rank}: {time.process_time() - started[0]:.1f} s CPU, "
          f"{time.perf_counter() - started[1]:.1f} s wall", flush=True)
    print(f"SUITE {label} ends rank={rank}: {'ok' if ok else 'failed'}", flush=True)
    return ok


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(f"usage: {sys.argv[0]} SPEC [SPEC ...] (JSON objects)")
    specs = [json.loads(arg) for arg in sys.argv[1:]]
    # kd.rank() is known inside a worker only; the launcher's variable (or,
    # in a self-started job, torchrun's) names the rank.
    rank = os.environ.get("PMI_RANK", os.environ.get("RANK", "?"))
    failed = [spec["label"] for spec in specs if not run_suite(spec, rank)]
    if failed:
        print(f"SUITES FAILED rank={rank}: {', '.join(failed)}", flush=True)
        sys.exit(1)
