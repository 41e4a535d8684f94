"""A rank for tests/multiprocess/test_launcher.py: prints, as one JSON line
prefixed ``REPORT``, what kdrun gave it (argv, environment, supervisor channel)."""

import json
import os
import socket
import sys

import keras_dist as kd

kd.init()
channel = os.environ.get("KERAS_DIST_SUPERVISOR_FD", "")
report = {
    "rank": kd.rank(),
    "size": kd.size(),
    "local_size": kd.local_size(),
    "argv": sys.argv[1:],
    "job_id": os.environ.get("KERAS_DIST_JOB_ID"),
    "status_dir": os.environ.get("KERAS_DIST_STATUS_DIR"),
    "supervisor_channel_is_a_socket": socket.socket(fileno=os.dup(int(channel))).type
    == socket.SOCK_STREAM if channel.isdigit() else False,
    "timeline": os.environ.get("KERAS_DIST_TIMELINE"),
    "host": socket.gethostname(),
}
kd.barrier()
print("REPORT " + json.dumps(report), flush=True)
