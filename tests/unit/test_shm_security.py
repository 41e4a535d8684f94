"""Shared-memory segments: private to the user, unguessable, gone once attached."""

import os
import re
import stat

from keras_dist import _native
from keras_dist.transports.shm import segment_name


def test_segment_names_are_scoped_to_user_and_job_and_unguessable():
    names = {segment_name("job42") for _ in range(100)}
    assert len(names) == 100  # a random part in every name
    for name in names:
        assert re.fullmatch(rf"/kd-{os.getuid()}-job42-[0-9a-f]{{16}}", name), name
    hostile = segment_name("../../etc/passwd")
    assert "/" not in hostile[1:] and hostile.startswith(f"/kd-{os.getuid()}-"), hostile


def test_segment_is_mode_0600_and_unlinked_once_every_rank_attached():
    name = segment_name("securitytest")
    path = "/dev/shm" + name
    old_umask = os.umask(0)  # even a permissive umask must not widen the mode
    try:
        engine = _native.ShmEngine(name, True, 0, 1, 1 << 16, [os.getpid()])
    finally:
        os.umask(old_umask)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode == 0o600, oct(mode)
        assert os.stat(path).st_uid == os.getuid()
        engine.attach()  # the only rank: everyone has attached
        assert not os.path.exists(path)
    finally:
        engine.unlink()
    assert not os.path.exists(path)
