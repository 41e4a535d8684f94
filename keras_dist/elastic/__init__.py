"""Elastic training (Horovod's ``hvd.elastic``): commit the state, survive a
lost rank or host, grow and shrink with the hosts.

MPI cannot resize a running job, so ``kdrun`` relaunches it (``--max-restarts``,
``--min-np``, ``--max-np``, ``--host-discovery-script``) and the ranks resume
from the newest commit that any machine still holds (``state``, ``store``).
"""

from keras_dist.elastic.data import ElasticData
from keras_dist.elastic.run import run
from keras_dist.elastic.state import ObjectState, State
from keras_dist.errors import HostsUpdatedInterrupt

_LAZY = {
    "KerasState": "keras_dist.elastic.keras_state",
    "CommitStateCallback": "keras_dist.elastic.callbacks",
    "UpdateBatchStateCallback": "keras_dist.elastic.callbacks",
    "UpdateEpochStateCallback": "keras_dist.elastic.callbacks",
}


def __getattr__(name: str):
    # Keras (and its backend) load only when a Keras part is used.
    if name not in _LAZY:
        raise AttributeError(f"module 'keras_dist.elastic' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "CommitStateCallback", "ElasticData", "HostsUpdatedInterrupt", "KerasState",
    "ObjectState", "State", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run",
]
