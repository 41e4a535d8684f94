"""GPU memory left to NCCL and the fusion buffers, set up at ``kd.init()``.

TensorFlow and JAX take a GPU's memory when they start using it (nearly all
of it, and 75%), unless told otherwise; NCCL's communicator and keras_dist's
fused buffers then find none. Each framework's glue says whether it started
already (``tf.glue.memory_notice``, ``jax_glue.memory_notice``).
"""

from __future__ import annotations

import os
import sys
import warnings

#: Settings that make TensorFlow and JAX take GPU memory as they need it,
#: rather than nearly all of it (TensorFlow) or 75% (JAX) when they start.
MEMORY_SETTINGS = {"TF_FORCE_GPU_ALLOW_GROWTH": "true", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def leave_gpu_memory() -> list[str]:
    """Leaves GPU memory to NCCL and the fusion buffers (at ``kd.init()``).

    Sets ``MEMORY_SETTINGS`` where the user has not set them (the framework
    reads them when it starts using its GPUs, so they serve a framework that
    has not yet), and, for a framework that has started already, says why
    the GPU collectives may run out of memory. Torch's allocator takes memory
    as it needs it. Returns the notices (also given as warnings).
    """
    before = {name: os.environ.get(name) for name in MEMORY_SETTINGS}
    for name, value in MEMORY_SETTINGS.items():
        os.environ.setdefault(name, value)
    notices = []
    if "tensorflow" in sys.modules:
        from keras_dist.tensor.tf import glue as tf_glue

        notices.append(tf_glue.memory_notice(before["TF_FORCE_GPU_ALLOW_GROWTH"]))
    if "jax" in sys.modules:
        from keras_dist.tensor import jax_glue

        notices.append(jax_glue.memory_notice(before["XLA_PYTHON_CLIENT_PREALLOCATE"]))
    notices = [n for n in notices if n]
    for notice in notices:
        warnings.warn(notice, RuntimeWarning, stacklevel=3)
    return notices
