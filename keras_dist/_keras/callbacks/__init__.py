"""Keras callbacks with Horovod's names and semantics."""

from keras_dist._keras.callbacks.backup_and_restore import BackupAndRestore
from keras_dist._keras.callbacks.best_model_checkpoint import BestModelCheckpoint
from keras_dist._keras.callbacks.broadcast_global_variables import BroadcastGlobalVariablesCallback
from keras_dist._keras.callbacks.join import JoinCallback
from keras_dist._keras.callbacks.learning_rate_schedule import LearningRateScheduleCallback
from keras_dist._keras.callbacks.learning_rate_warmup import LearningRateWarmupCallback
from keras_dist._keras.callbacks.metric_average import MetricAverageCallback
from keras_dist._keras.callbacks.timeline import TimelineCallback

__all__ = [
    "BackupAndRestore",
    "BestModelCheckpoint",
    "BroadcastGlobalVariablesCallback",
    "JoinCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
    "TimelineCallback",
]
