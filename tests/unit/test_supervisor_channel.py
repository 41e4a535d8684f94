"""The rank supervisor when its child exits with a host-update notice unread.

In an elastic job the supervisor passes kdrun's ``hosts-updated N`` lines to
its child over a socket pair. A child that exits without reading one closes
its end with data unread, and the supervisor's next read gets ECONNRESET:
that must end the watch as the child's exit does, not crash the supervisor
(which left kdrun waiting until its timeout).
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import keras_dist.launcher.supervisor as supervisor

SUPERVISOR = Path(supervisor.__file__)


def test_an_unread_notice_at_the_childs_exit_ends_the_watch_cleanly():
    env = dict(os.environ, KERAS_DIST_ELASTIC_JOB="test", PMI_RANK="0")
    child = [sys.executable, "-c", "import time; time.sleep(1.0)"]
    proc = subprocess.Popen([sys.executable, str(SUPERVISOR), "--", *child],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    try:
        time.sleep(0.4)  # the child runs; the notice reaches its socket unread
        proc.stdin.write(b"hosts-updated 1\n")
        proc.stdin.flush()
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert b"Traceback" not in err, err.decode()
    assert proc.returncode == 0, err.decode()
