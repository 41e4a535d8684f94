"""The local multi-node Ray cluster of tests/cluster/test_ray.py and
tests/cluster/ray_timing.py: a head node without CPUs (only Ray's own
services run there) and worker nodes, each a raylet of its own, all on this
machine."""

from __future__ import annotations

from pathlib import Path

from ray.cluster_utils import Cluster

REPO_ROOT = Path(__file__).resolve().parents[2]
#: The workers' environment: the tree importable (tests.cluster.ray_workers),
#: one framework thread each (this machine has 2 cores), quiet TensorFlow.
WORKER_ENV = {
    "PYTHONPATH": str(REPO_ROOT),
    "KERAS_BACKEND": "tensorflow",
    "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", "OMP_NUM_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "KERAS_DIST_TIMEOUT_SECONDS": "60",
}
OBJECT_STORE_BYTES = 80 << 20


def start_local_cluster(worker_nodes: int, cpus_per_node: int) -> Cluster:
    """Starts the cluster and waits for its nodes; the caller shuts it down."""
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": False})
    try:
        for _ in range(worker_nodes):
            cluster.add_node(num_cpus=cpus_per_node, object_store_memory=OBJECT_STORE_BYTES)
        cluster.wait_for_nodes()
    except BaseException:
        cluster.shutdown()
        raise
    return cluster
