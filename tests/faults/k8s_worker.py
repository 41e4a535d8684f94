"""A training process as a Kubernetes pod runs it (test_kubernetes.py): under
kdrun in an MPIJob, or started by the pod itself (an indexed Job, a Kubeflow
TrainJob, torchrun), finding its place in the variables the pod has.

``k8s_worker.py check``: times ``kd.init()``, checks a float64 allreduce
against numpy on every rank (and that all ranks got the same bits), and
prints ``REPORT {json}`` with the topology.
``k8s_worker.py loop``: allreduces until it is ended, printing ``UP rank host
pid`` and touching ``$K8S_READY_DIR/rank<r>`` once the first one is done.
"""

import hashlib
import json
import os
import socket
import sys
import time

import numpy as np

import keras_dist as kd

started = time.monotonic()
kd.init()
init_seconds = time.monotonic() - started
rank, size = kd.rank(), kd.size()
if sys.argv[1] == "check":
    values = np.linspace(-1.0, 1.0, 4099, dtype=np.float64) * (rank + 1) + rank / 3
    total = kd.allreduce(values, op=kd.Sum)
    expected = sum(np.linspace(-1.0, 1.0, 4099, dtype=np.float64) * (r + 1) + r / 3
                   for r in range(size))
    hosts = kd.allgather_object(socket.gethostname())
    # Every rank must end with the same bits, whatever the order it summed in.
    digests = kd.allgather_object(hashlib.sha256(total.tobytes()).hexdigest())
    report = {
        "rank": rank, "size": size, "host": socket.gethostname(), "hosts": hosts,
        "local_rank": kd.local_rank(), "local_size": kd.local_size(),
        "cross_rank": kd.cross_rank(), "cross_size": kd.cross_size(),
        "allreduce_error": float(np.max(np.abs(total - expected))),
        "agreed": len(set(digests)) == 1,
        "init_seconds": init_seconds,
    }
    kd.barrier()
    # One write: the processes of a pod share its output.
    sys.stdout.write("REPORT " + json.dumps(report) + "\n")
    sys.stdout.flush()
else:
    data = np.ones(1 << 16, np.float32)
    kd.allreduce(data, op=kd.Sum)
    sys.stdout.write(f"UP {rank} {socket.gethostname()} {os.getpid()}\n")
    sys.stdout.flush()
    open(os.path.join(os.environ["K8S_READY_DIR"], f"rank{rank}"), "w").close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        kd.allreduce(data, op=kd.Sum)
