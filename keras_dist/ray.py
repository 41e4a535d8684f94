"""keras_dist on a Ray cluster: ``RayExecutor``, as ``horovod.ray`` had it.

The code lives in ``keras_dist.clusters.ray``. Ray is imported with this
module (``import keras_dist`` does not import it).
"""

try:
    import ray  # noqa: F401
except ImportError as error:
    raise ImportError(
        "keras_dist.ray needs Ray, which is not installed: pip install 'ray>=2.9' (or, from "
        f"a clone of keras_dist, pip install '.[ray]'). ({error})") from error

from keras_dist.clusters.ray.executor import RayExecutor, RaySettings

__all__ = ["RayExecutor", "RaySettings"]
