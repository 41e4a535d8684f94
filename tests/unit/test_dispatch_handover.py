"""The one-call native collectives (``_native.dispatch_*``) serve exactly where the
runtime handed them an engine and the timeline said it does not record.

C++ reads no Python object's attributes: the engine comes from
``set_dispatch_engine`` (``context.install``), recording from
``set_dispatch_recording`` (``timeline.start_timeline``)."""

import numpy as np
import pytest

from keras_dist import _native
from keras_dist.tensor import ops  # noqa: F401 - hands the counters and ops over
from keras_dist.transports.base import Transport
from keras_dist.transports.local import LocalTransport


@pytest.fixture
def engine(one_rank_engine):
    yield one_rank_engine
    _native.set_dispatch_engine(None)
    _native.set_dispatch_recording(False)


def test_the_entries_serve_only_with_an_engine_handed_over_and_no_recording(engine):
    x = np.arange(5, dtype=np.float32)
    assert _native.dispatch_allreduce(x, None, "t") is None  # no engine handed over
    _native.set_dispatch_engine(engine)
    before = _native.dispatch_served()
    np.testing.assert_array_equal(_native.dispatch_allreduce(x, None, "t"), x)
    np.testing.assert_array_equal(_native.dispatch_broadcast(x, 0, "t"), x)
    np.testing.assert_array_equal(_native.dispatch_allgather(x, "t"), x)
    assert _native.dispatch_served() - before == 3
    _native.set_dispatch_recording(True)
    assert _native.dispatch_allreduce(x, None, "t") is None  # the general path records
    _native.set_dispatch_recording(False)
    _native.set_dispatch_engine(None)
    assert _native.dispatch_allreduce(x, None, "t") is None
    assert _native.dispatch_served() - before == 3


def test_only_an_engine_is_handed_over():
    with pytest.raises(TypeError, match="ShmEngine or None"):
        _native.set_dispatch_engine(object())


def test_a_transport_declares_its_engine_and_capabilities():
    transport = LocalTransport()
    assert isinstance(transport, Transport)
    assert transport.native_engine() is None and not transport.reduces_parts
    error = ValueError("mismatch")
    with pytest.raises(ValueError, match="mismatch"):
        transport.allreduce_mismatched(error, np.zeros(1), 0, "x")
    with pytest.raises(NotImplementedError):
        transport.allreduce_parts([np.zeros(1)], [np.zeros(1)], 0)
