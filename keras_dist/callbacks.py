"""Public path of the Keras callbacks (``keras_dist._keras.callbacks``)."""

from keras_dist._keras.callbacks import *  # noqa: F403
from keras_dist._keras.callbacks import __all__  # noqa: F401
