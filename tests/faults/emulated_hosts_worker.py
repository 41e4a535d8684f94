"""A rank of a job on emulated hosts (test_emulated_hosts.py).

``emulated_hosts_worker.py check``: a float32 allreduce checked against the
same sum in float64, then ``REPORT {json}`` with the rank, its host, its
pid, and its placement.
``emulated_hosts_worker.py hold``: prints ``HELD rank pid`` and blocks reading
stdin (its host is torn down around it).
"""

import json
import os
import socket
import sys

import numpy as np

if sys.argv[1] == "hold":
    print("HELD", os.environ.get("RANK", "?"), os.getpid(), flush=True)
    sys.stdin.read()
    sys.exit(0)

import keras_dist as kd  # noqa: E402

kd.init()
rank, size = kd.rank(), kd.size()
values = np.random.default_rng(rank).standard_normal(4099).astype(np.float32)
total = kd.allreduce(values, op=kd.Sum)
everyone = [np.random.default_rng(r).standard_normal(4099).astype(np.float32)
            for r in range(size)]
exact = np.sum([v.astype(np.float64) for v in everyone], axis=0)
report = {"rank": rank, "size": size, "host": socket.gethostname(), "pid": os.getpid(),
          "cross_size": kd.cross_size(), "local_size": kd.local_size(),
          "max_error": float(np.max(np.abs(total - exact))),
          "ok": bool(np.allclose(total, exact, rtol=1e-5, atol=1e-5))}
kd.barrier()
print("REPORT " + json.dumps(report), flush=True)
