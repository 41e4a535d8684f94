"""Run a function as one keras_dist job on a Spark cluster, in barrier execution
mode: ``keras_dist.spark.run``, as ``horovod.spark.run``.

The code lives in ``keras_dist.clusters.spark``. Importing this module
imports no Spark.
"""

from keras_dist.clusters.spark.driver import run

__all__ = ["run"]
