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
from pathlib import Path

import keras_dist.launcher.supervisor as supervisor

SUPERVISOR = Path(supervisor.__file__)


#: The child: says it runs, then exits as soon as a notice is waiting on its
#: channel, without reading it (``select`` only looks), or with status 3 if
#: none comes within a minute.
CHILD = """
import os, select, sys
channel = int(os.environ["KERAS_DIST_SUPERVISOR_FD"])
print("child running", flush=True)
sys.exit(0 if select.select([channel], [], [], 60)[0] else 3)
"""


def test_an_unread_notice_at_the_childs_exit_ends_the_watch_cleanly():
    env = dict(os.environ, KERAS_DIST_ELASTIC_JOB="test", PMI_RANK="0")
    proc = subprocess.Popen([sys.executable, str(SUPERVISOR), "--", sys.executable, "-c", CHILD],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    try:
        for line in proc.stdout:  # the supervisor's frames: heartbeats, then the child's line
            if line.endswith(b" on child running\n"):
                break
        else:
            raise AssertionError(f"the child never ran: {proc.stderr.read().decode()}")
        proc.stdin.write(b"hosts-updated 1\n")
        proc.stdin.flush()
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert b"Traceback" not in err, err.decode()
    assert proc.returncode == 0, err.decode()
