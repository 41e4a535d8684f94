"""A rank for the fault-injection tests: ``fault_worker.py MODE``.

Every rank prints ``SHM <name>...`` (the /dev/shm files it maps once keras_dist
is up) so that a test can check they are gone after the job; then, with
``FAULT_READY_DIR`` set, touches ``<dir>/rank<r>.ready``. Rank 1 (``FAULT_RANK``)
then injects the fault named by MODE while the others carry on into the next
collective:

- ``ok``: no fault.
- ``raise``: raises ValueError("injected fault") while peers wait in allreduce.
- ``kill_barrier``: SIGKILLs itself while peers wait in a barrier.
- ``kill_allreduce``: SIGKILLs itself from a thread in the middle of a stream
  of large allreduces.
- ``exit0`` / ``exit3``: leaves with ``os._exit(0)`` / ``os._exit(3)``.
- ``raise_before_init``: raises before ``keras_dist.init()``.
- ``hang``: every rank sleeps (to be signalled).
- ``hang_ignoring_signals``: every rank ignores SIGINT and SIGTERM, then sleeps.
"""

import os
import signal
import sys
import threading
import time

import numpy as np

mode = sys.argv[1]
fault_rank = int(os.environ.get("FAULT_RANK", "1"))
world_rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
if mode == "raise_before_init" and world_rank == fault_rank:
    raise RuntimeError("injected fault before init")

import keras_dist as kd  # noqa: E402

kd.init()
rank, size = kd.rank(), kd.size()
kd.allreduce(np.ones(1024, np.float32), op=kd.Sum)


def mapped_shm():
    names = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "/dev/shm/" in line:
                names.add(line.split("/dev/shm/", 1)[1].split()[0])
    return sorted(names)


if mode == "hang_ignoring_signals":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("SHM", *mapped_shm(), flush=True)
ready_dir = os.environ.get("FAULT_READY_DIR")
if ready_dir:
    open(os.path.join(ready_dir, f"rank{rank}.ready"), "w").close()

faulty = rank == fault_rank
if mode == "raise":
    if faulty:
        time.sleep(0.5)
        raise ValueError("injected fault")
    kd.allreduce(np.ones(1000, np.float32))
elif mode == "kill_barrier":
    if faulty:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    kd.barrier()
elif mode == "kill_allreduce":
    if faulty:
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
    data = np.ones(1 << 20, np.float32)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        kd.allreduce(data, op=kd.Sum)
elif mode == "segfault":
    if faulty:
        time.sleep(0.5)

        def crash_in_native_code():
            import ctypes

            ctypes.string_at(0)

        crash_in_native_code()
    kd.barrier()
elif mode in ("exit0", "exit3"):
    if faulty:
        time.sleep(0.5)
        os._exit(0 if mode == "exit0" else 3)
    kd.barrier()
elif mode in ("hang", "hang_ignoring_signals"):
    time.sleep(120)
elif mode != "ok":
    raise SystemExit(f"unknown mode {mode!r}")
kd.barrier()
print("FINISHED", rank, flush=True)
