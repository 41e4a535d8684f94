"""TensorFlow error classes for keras_dist's errors.

A TF caller catches ``tf.errors.OpError`` subclasses: a mismatch between
ranks is a ``FailedPreconditionError``, a bad argument an
``InvalidArgumentError``. Eagerly, keras_dist raises classes that are both
its own error and the TF one. Inside a graph, TF itself builds the error
from a status code when the step fails: ``numpy_function`` turns a Python
``ValueError``/``TypeError`` into INVALID_ARGUMENT and a
``NotImplementedError`` into UNIMPLEMENTED, but any other exception into
UNKNOWN, whatever its class. So a mismatch inside a graph leaves the numpy
function normally and hands its message to a ``ReadFile`` op: reading a
path below ``os.devnull`` fails with FAILED_PRECONDITION ("Not a
directory"), and the message travels as that path. When nothing failed the
status is ``os.devnull`` itself and the graph skips the read.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import numpy as np

from keras_dist.errors import CollectiveMismatchError
from keras_dist.tensor.kinds import is_tf, unwrap

# A failed step's status is this prefix and the message; a good one's, SUCCESS.
FAILURE_PREFIX = os.devnull + "/"
SUCCESS = np.bytes_(os.devnull.encode())
# What a good step's numpy function returns as its status: TensorFlow passes
# a 0-d object array of bytes through as it is, where a bytes scalar costs it
# a second conversion (``FuncRegistry._convert``).
SUCCESS_OUT = np.array(SUCCESS, dtype=object)


def _tf_error_class(error: BaseException):
    """The TF ``OpError`` class matching ``error``, or None."""
    import tensorflow as tf

    if isinstance(error, CollectiveMismatchError):
        return tf.errors.FailedPreconditionError
    if isinstance(error, (ValueError, TypeError)):
        return tf.errors.InvalidArgumentError
    if isinstance(error, NotImplementedError):
        return tf.errors.UnimplementedError
    return None


@functools.cache
def _dual_class(error_class: type, tf_class: type) -> type:
    """A class that is both ``error_class`` and ``tf_class``, named as ``error_class``."""

    def __init__(self, message: str, state: dict) -> None:
        tf_class.__init__(self, None, None, message)
        self.args = (message,)
        self.__dict__.update(state)

    def __reduce__(self):  # travels as the keras_dist error alone
        plain = error_class.__new__(error_class)
        plain.args = self.args
        plain.__dict__.update({k: v for k, v in vars(self).items() if not k.startswith("_")})
        return plain.__reduce__()

    return type(error_class.__name__, (error_class, tf_class), {
        "__init__": __init__, "__reduce__": __reduce__,
        "__module__": error_class.__module__, "__qualname__": error_class.__qualname__,
        "__str__": BaseException.__str__,
    })


def as_tf_error(error: BaseException) -> BaseException:
    """``error`` as an instance that is also the matching TF ``OpError``.

    Errors with no TF counterpart, and those that already are one, are
    returned as they are.
    """
    import tensorflow as tf

    tf_class = _tf_error_class(error)
    if tf_class is None or isinstance(error, tf.errors.OpError):
        return error
    state = {k: v for k, v in vars(error).items() if not k.startswith("_")}  # e.g. peer_rank
    dual = _dual_class(type(error), tf_class)(str(error), state)
    dual.__traceback__ = error.__traceback__
    return dual


def not_converted_by_autograph(function: Callable) -> Callable:
    """Marks ``function`` so that a ``tf.function`` calls it as plain Python.

    AutoGraph rewrites the Python code a ``tf.function`` calls, module by
    module, unless told otherwise; keras_dist's own code builds its graph ops
    itself and must run as written (a rewritten call can fail while tracing).
    TF's ``do_not_convert`` decorator marks a function with this attribute;
    setting it directly keeps TensorFlow out of this module's import.
    """
    function.autograph_info__ = frozenset()
    return function


def raising_tf_errors(function: Callable) -> Callable:
    """Decorates a collective: when any argument is a TF value, its errors are
    raised as ``as_tf_error`` makes them (checks made before ``run`` included).
    The collective runs unconverted inside a ``tf.function``
    (``not_converted_by_autograph``)."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except (CollectiveMismatchError, ValueError, TypeError, NotImplementedError) as error:
            if not _mentions_tf(args) and not _mentions_tf(kwargs.values()):
                raise
            raise as_tf_error(error) from error.__cause__

    return not_converted_by_autograph(wrapper)


def _mentions_tf(values) -> bool:
    for value in values:
        if isinstance(value, (list, tuple)):
            if any(is_tf(unwrap(v)) for v in value):
                return True
        elif is_tf(unwrap(value)):
            return True
    return False
