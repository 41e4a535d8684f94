"""What the TensorFlow API workers (``exchange.py``, ``tf_api.py``) share: each
rank's seeded random inputs, Horovod's scaling rule for the references, and a
TF1 graph run in a session."""

import numpy as np


def data(case, rank, shape, dtype=np.float64, low=-10.0, high=10.0):
    """Rank ``rank``'s random input for test case ``case`` (never all zeros).
    Unsigned integers are drawn from ``[max(low, 0), high)``."""
    rng = np.random.default_rng([case, rank])
    if np.dtype(dtype).kind in "iu":
        return rng.integers(int(max(low, 0) if np.dtype(dtype).kind == "u" else low),
                            int(high), shape).astype(dtype)
    if np.dtype(dtype).kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    return rng.uniform(low, high, shape).astype(dtype)


def scaled(values, factor, dtype):
    """Horovod's scaling: integers in float64 then truncated, halves in float32."""
    if np.dtype(dtype).kind in "iu":
        return np.trunc(values.astype(np.float64) * factor).astype(dtype)
    if np.dtype(dtype) == np.float16:
        return (values.astype(np.float32) * np.float32(factor)).astype(np.float16)
    return (values * np.asarray(factor, dtype)).astype(dtype)


def in_graph(build):
    """Builds ``build()`` in a TF1 graph and evaluates it in a session."""
    import tensorflow as tf

    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        fetches = build()
        session.run(tf.compat.v1.global_variables_initializer())
        return session.run(fetches)
