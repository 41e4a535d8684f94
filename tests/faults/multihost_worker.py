"""A rank of a job spread over network-namespace "hosts" (test_multihost.py).

``multihost_worker.py check``: allreduce, allgather and broadcast against
exact references; prints ``REPORT {json}`` with the topology and the number
of TCP connections this rank's host holds to the other host (so the test can
see MPI really crossed the network).
``multihost_worker.py loop``: allreduces for a minute (a rank or a host gets
killed), printing ``UP rank host pid`` and touching
``$FAULT_READY_DIR/rank<r>.ready`` once the first one is done.
"""

import json
import os
import socket
import sys
import time

import numpy as np

import keras_dist as kd


def tcp_to_other_hosts():
    """Established TCP connections from this network namespace to other test hosts."""
    launch = os.environ["KD_LAUNCH_ADDRESS"]
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.connect((launch, 9))
    mine = probe.getsockname()[0]
    probe.close()
    subnet = launch.rsplit(".", 1)[0] + "."
    count = 0
    with open("/proc/net/tcp") as handle:
        next(handle)
        for line in handle:
            fields = line.split()
            address = socket.inet_ntoa(bytes.fromhex(fields[2].split(":")[0])[::-1])
            if fields[3] == "01" and address.startswith(subnet) and address not in (launch, mine):
                count += 1
    return count


kd.init()
rank, size = kd.rank(), kd.size()
if sys.argv[1] == "check":
    values = np.arange(1000, dtype=np.float64) * (rank + 1)
    total = kd.allreduce(values, op=kd.Sum)
    expected = np.arange(1000, dtype=np.float64) * (size * (size + 1) // 2)
    gathered = kd.allgather(np.full((rank + 1, 2), rank, np.int32))
    root = kd.broadcast(np.full(7, rank + 10, np.int64), root_rank=size - 1)
    report = {
        "rank": rank,
        "host": socket.gethostname(),
        "local_rank": kd.local_rank(), "local_size": kd.local_size(),
        "cross_rank": kd.cross_rank(), "cross_size": kd.cross_size(),
        "allreduce_ok": bool(np.array_equal(total, expected)),
        "allgather_ok": gathered.shape == (size * (size + 1) // 2, 2)
        and [int(v) for v in gathered[:, 0]] == [r for r in range(size) for _ in range(r + 1)],
        "broadcast_ok": bool(np.all(root == size - 1 + 10)),
        "tcp_to_other_hosts": tcp_to_other_hosts(),
    }
    kd.barrier()
    print("REPORT " + json.dumps(report), flush=True)
else:
    data = np.ones(1 << 16, np.float32)
    kd.allreduce(data, op=kd.Sum)
    print("UP", rank, socket.gethostname(), os.getpid(), flush=True)
    open(os.path.join(os.environ["FAULT_READY_DIR"], f"rank{rank}.ready"), "w").close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        kd.allreduce(data, op=kd.Sum)
