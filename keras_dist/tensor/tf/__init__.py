"""TensorFlow's part of the tensor layer, in one place.

- ``ops``: the TensorFlow side of the collectives (gradients, rank ops).
- ``functions``: Horovod's TensorFlow helper functions.
- ``kernel``: keras_dist's own TensorFlow ops for a traced step.
- ``glue``: TensorFlow GPU tensors on the device path (DLPack to cupy and back).
- ``errors``: TensorFlow error classes for keras_dist's errors.
- ``tf.graph_buffer``: a traced step's ``numpy_function`` outputs as one buffer.

Each module imports TensorFlow; the rest of the tensor layer imports them
only when a TensorFlow value reaches it.
"""
