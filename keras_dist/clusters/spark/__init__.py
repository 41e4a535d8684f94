"""keras_dist on a Spark cluster, in barrier execution mode (``keras_dist.spark``
is the public path): the driver's code (``driver.py``: ``run`` and the relay
it listens on), a barrier task's (``task.py``), the rank's own process that a
task starts (``child.py``) and what a task tells the driver (``relay.py``)."""
