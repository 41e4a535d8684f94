"""Keras callbacks with Horovod's names and semantics."""

from keras_dist.callbacks.broadcast_global_variables import BroadcastGlobalVariablesCallback
from keras_dist.callbacks.learning_rate_schedule import LearningRateScheduleCallback
from keras_dist.callbacks.learning_rate_warmup import LearningRateWarmupCallback
from keras_dist.callbacks.metric_average import MetricAverageCallback

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
]
