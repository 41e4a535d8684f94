"""TimelineCallback: train steps as spans on the timeline."""

from __future__ import annotations

import keras

from keras_dist._runtime import timeline


class TimelineCallback(keras.callbacks.Callback):
    """Records every train batch as a span ``step E:B`` on this rank's timeline.

    It costs two clock reads per batch while a timeline records (``kdrun
    --timeline``, ``KERAS_DIST_TIMELINE`` or ``keras_dist.start_timeline``)
    and one attribute check otherwise. The step spans sit on their own track
    above the collectives, so a step's share of waiting and moving data shows
    under it; the end-of-job summary counts the time in steps.

    Example:

    ```python
    model.fit(x, y, callbacks=[kd.callbacks.BroadcastGlobalVariablesCallback(0),
                               kd.callbacks.TimelineCallback()])
    ```
    """

    def __init__(self) -> None:
        super().__init__()
        self._epoch = 0
        self._start: float | None = None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self._start = timeline.now_ns() if timeline.enabled() else None

    def on_train_batch_end(self, batch, logs=None):
        if self._start is not None:
            timeline.record_step(f"step {self._epoch}:{batch}", self._start, timeline.now_ns())
            self._start = None
