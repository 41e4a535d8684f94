"""A rank for tests/multiprocess/test_launcher.py: prints, as one JSON line
prefixed ``REPORT``, what kdrun gave it (argv, environment, status directory)."""

import json
import os
import socket
import stat
import sys

import keras_dist as kd

kd.init()
status_dir = os.environ.get("KERAS_DIST_STATUS_DIR", "")
report = {
    "rank": kd.rank(),
    "size": kd.size(),
    "local_size": kd.local_size(),
    "argv": sys.argv[1:],
    "job_id": os.environ.get("KERAS_DIST_JOB_ID"),
    "status_dir": status_dir,
    "status_dir_mode": stat.S_IMODE(os.stat(status_dir).st_mode) if status_dir else None,
    "timeline": os.environ.get("KERAS_DIST_TIMELINE"),
    "host": socket.gethostname(),
}
kd.barrier()
print("REPORT " + json.dumps(report), flush=True)
