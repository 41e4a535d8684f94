"""Fixtures shared by the one-process tests."""

import os
import secrets

import pytest


@pytest.fixture
def one_rank_engine():
    """A shm engine of one rank (its own segment, removed afterwards)."""
    from keras_dist import _native

    engine = _native.ShmEngine(f"/kd-test-{os.getpid()}-{secrets.token_hex(4)}", True, 0, 1,
                               1 << 16, [os.getpid()])
    engine.attach()
    yield engine
    engine.leave()
    engine.unlink()


@pytest.fixture(scope="module")
def initialised():
    """keras_dist initialised (one rank) for a module's tests, shut down after them."""
    import keras_dist as kd

    kd.init()
    yield
    kd.shutdown()
