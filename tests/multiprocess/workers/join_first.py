"""Runs a worker written for mpiexec, one that imports ``mpi4py.MPI`` before
``kd.init()``, in a self-started job: ``python join_first.py WORKER ARGS...``.

It meets the other ranks first (what ``kd.init()`` does before MPI starts);
the worker's own ``kd.init()`` then finds the job formed.
"""

import os
import runpy
import sys

from keras_dist._config import Config
from keras_dist._runtime import placement, rendezvous

place = placement.from_environment(os.environ)
assert place is not None, "join_first.py runs under torchrun's or Kubeflow's variables"
rendezvous.join(place, Config.from_env().rendezvous_timeout_seconds)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
