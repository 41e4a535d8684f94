"""keras_dist on a Ray cluster (``keras_dist.ray`` is the public path):
``RayExecutor`` (``executor.py``, the driver's code), the rank actors
(``worker.py``), the process manager's actor (``process_manager.py``) and the
placement arithmetic (``layout.py``, which imports no Ray)."""
