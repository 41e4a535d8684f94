"""Where training is in the epoch, kept by the elastic callbacks, saved in every commit.

Horovod's callbacks update ``state.batch`` and ``state.epoch`` each in its
own ``on_epoch_end``, so what a commit made in the same ``on_epoch_end``
holds depends on the order of the callbacks, and the epoch count goes wrong
when ``fit`` is given ``initial_epoch`` or when the job is resized. Here the
updates live in one object that every elastic callback calls: each update
happens once, whichever callback calls it first, so a commit always sees the
counters of the batch or epoch just finished.

Counters:

- ``state.batch``: batches finished in the current epoch, in batches of the
  current size; 0 between epochs.
- ``state.epoch``: epochs finished, counted across every launch of the job
  (it moves on with the epoch's last batch, when ``fit`` knows the steps);
  ``fit`` may be called with ``epochs=E - state.epoch`` (Horovod's examples)
  or with ``initial_epoch=state.epoch``: the offset between Keras' epoch
  index and the state's is taken at the first epoch of each ``fit``.

After a relaunch at another size the epoch being resumed runs only the
steps that remain: the remaining samples when the data come from
``keras_dist.elastic.ElasticData`` (exact), else the remaining fraction of
the epoch's batches, rounded up. ``fit`` cannot run a shorter epoch, so the
callback ends it early (``stop_training``) and lets the next epoch start.
"""

from __future__ import annotations

import math

from keras_dist._runtime import context


class Progress:
    """The epoch and batch counters of one state (see the module docstring)."""

    def __init__(self, state) -> None:
        self.state = state
        #: Set by UpdateBatchStateCallback / UpdateEpochStateCallback.
        self.track_batch = False
        self.track_epoch = False
        #: An ``ElasticData`` feeding this state's training, if any.
        self.data = None
        #: What the commit restored by ``sync`` said (None: a fresh start).
        self.resume: dict | None = None
        self._new_fit()

    def _new_fit(self) -> None:
        self.model = None
        self.steps = None
        self.epoch_offset = None
        self.first_epoch = None
        self.current_epoch = None
        self.ended_epoch = None
        self.batch_offset = 0
        self.done = 0
        self.samples = 0
        self.stopped_early = False

    # --- commits ---------------------------------------------------------------

    def snapshot(self) -> dict:
        """This object's part of a commit."""
        return {"steps": self.steps, "done": self.done,
                "samples": self.samples if self.data is not None else None}

    def restore(self, saved: dict, size: int) -> None:
        """Takes back what a commit made at ``size`` ranks said."""
        self.resume = dict(saved, size=size)
        finished = saved.get("samples") is not None and self.data is not None and (
            saved["samples"] >= self.data.num_samples) or (
            saved.get("steps") and saved.get("done", 0) >= saved["steps"])
        if finished:  # committed after the epoch's last batch, before its end
            self.resume = None
            if self.track_epoch and hasattr(self.state, "epoch"):
                self.state.epoch += 1
            if self.track_batch and hasattr(self.state, "batch"):
                self.state.batch = 0

    def resume_samples(self) -> int:
        """Samples of the current epoch already trained on, in the commit resumed."""
        if self.resume is None or self.resume.get("samples") is None:
            return 0
        return int(self.resume["samples"])

    # --- fit events, each applied once -----------------------------------------

    def begin_train(self, model, params: dict) -> None:
        self._new_fit()
        self.model = model
        self.steps = params.get("steps")
        resume = self.resume  # taken back at the first epoch (every callback calls this)
        if resume is None or not self.track_batch or not self.steps:
            return
        size = context.get().size
        if self.data is not None and resume.get("samples") is not None:
            remaining = self.data.remaining_steps(resume["samples"])
            self.samples = resume["samples"]
        elif resume.get("steps") and resume.get("done"):
            remaining = math.ceil((resume["steps"] - resume["done"]) * resume["size"] / size)
        else:
            return
        self.batch_offset = max(0, self.steps - remaining)
        self.done = self.batch_offset
        if hasattr(self.state, "batch"):
            self.state.batch = self.batch_offset

    def begin_epoch(self, epoch: int) -> None:
        if self.current_epoch == epoch:
            return
        if self.first_epoch is None:
            self.first_epoch = epoch
            self.resume = None
            self.epoch_offset = (self.state.epoch - epoch) if (
                self.track_epoch and isinstance(getattr(self.state, "epoch", None), int)) else 0
        else:
            self.batch_offset = 0
            self.done = 0
            self.samples = 0
        self.current_epoch = epoch

    def end_batch(self, batch: int) -> None:
        done = self.batch_offset + batch + 1
        if done == self.done or self.ended_epoch == self.current_epoch:
            return  # seen already, or the epoch is finished
        if self.data is not None:
            self.samples += self.data.batch_samples(self.samples) * (done - self.done)
        self.done = done
        if self.track_batch and hasattr(self.state, "batch"):
            self.state.batch = done
        if self.batch_offset and self.steps and done >= self.steps and self.model is not None:
            # The resumed epoch has run the steps that were left: end it here.
            self.model.stop_training = True
            self.stopped_early = True
        if self.steps and done >= self.steps:
            # The epoch's last batch: a commit made now belongs to the next epoch.
            self._finish_epoch(self.current_epoch)

    def end_epoch(self, epoch: int) -> None:
        self._finish_epoch(epoch)
        if self.stopped_early and self.model is not None:
            self.model.stop_training = False
            self.stopped_early = False

    def _finish_epoch(self, epoch) -> None:
        """The counters' move to the next epoch, once per epoch."""
        if self.ended_epoch == epoch:
            return
        self.ended_epoch = epoch
        self.batch_offset = 0
        self.done = 0
        self.samples = 0
        if self.track_batch and hasattr(self.state, "batch"):
            self.state.batch = 0
        if self.track_epoch and hasattr(self.state, "epoch"):
            self.state.epoch = epoch + (self.epoch_offset or 0) + 1
