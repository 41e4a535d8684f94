"""One intra-op and one inter-op thread in a test rank, for the backend Keras will use.

Only that backend's framework is imported (TensorFlow alone costs seconds of
CPU): call before importing Keras.
"""

import os


def one_thread_per_rank() -> None:
    """Limits the framework named by ``KERAS_BACKEND`` (TensorFlow by default) to one thread."""
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    if backend == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    elif backend == "torch":
        import torch

        torch.set_num_threads(1)
