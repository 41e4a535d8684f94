"""``ElasticData``: arrays fed to ``fit`` so that a relaunch at any size
neither skips nor repeats a sample of the epoch it resumes.

Each epoch takes the samples in one order (a permutation drawn from
``shuffle_seed`` and the epoch number, or their own order), cut into global
batches of ``batch_size * size()`` samples; rank ``r`` trains on the ``r``-th
part of each global batch. Commits record how many samples of the epoch the
finished batches held. After a relaunch, at the same size or another, the
epoch being resumed goes on from the first sample not yet trained on, in the
same order, cut into global batches of the new size; the epochs after it are
whole. So across the job every sample of every epoch is trained on exactly
once in the committed history (the batches after the last commit, lost with
the failed launch, are trained on again), and a relaunch at the same size
sees exactly the batches an uninterrupted run would have.

Use it with ``UpdateBatchStateCallback`` (which ends the resumed epoch once
its remaining steps are done) and a state holding ``epoch``::

    data = kd.elastic.ElasticData((x, y), batch_size=32, state=state, shuffle_seed=1)
    model.fit(data.batches(), steps_per_epoch=data.steps_per_epoch(), ...)
"""

from __future__ import annotations

import math

import numpy as np

from keras_dist._runtime import context


class ElasticData:
    """This rank's batches of numpy data in an elastic job (module docstring).

    Args:
        data: a numpy array, or a tuple/list/dict of numpy arrays with the
            same first dimension (as ``fit`` takes them: ``(x, y)``...).
        batch_size: the local (per-rank) batch size.
        state: the elastic state of the job; its ``epoch`` attribute (0 when
            absent) says which epoch the batches start in.
        shuffle_seed: draw each epoch's order from this seed and the epoch
            number; None keeps the samples' own order.

    Raises:
        ValueError: arrays of different lengths, ``batch_size`` < 1, or fewer
            samples than ranks in some global batch.
    """

    def __init__(self, data, *, batch_size: int, state, shuffle_seed: int | None = None) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"`batch_size` must be a whole number >= 1. Received: {batch_size!r}")
        self._keys = list(data) if isinstance(data, dict) else None
        if isinstance(data, dict):
            arrays = [np.asarray(data[k]) for k in self._keys]
        elif isinstance(data, (tuple, list)):
            arrays = [np.asarray(a) for a in data]
        else:
            arrays = [np.asarray(data)]
        self._single = not isinstance(data, (tuple, list, dict))
        lengths = {len(a) for a in arrays}
        if len(lengths) != 1:
            raise ValueError("Every array must have the same first dimension. "
                             f"Received: lengths={[len(a) for a in arrays]}")
        self._arrays = arrays
        self.num_samples = lengths.pop()
        self.batch_size = batch_size
        self.shuffle_seed = shuffle_seed
        self.state = state
        state.progress.data = self

    def global_batch(self) -> int:
        return self.batch_size * context.get().size

    def steps_per_epoch(self) -> int:
        """Steps of a whole epoch at the current size (the last global batch may be smaller)."""
        return self.remaining_steps(0)

    def remaining_steps(self, samples_done: int) -> int:
        """Steps left in an epoch of which ``samples_done`` samples are trained on."""
        return math.ceil(max(0, self.num_samples - samples_done) / self.global_batch())

    def batch_samples(self, samples_done: int) -> int:
        """Samples in the global batch that starts after ``samples_done`` samples."""
        return min(self.global_batch(), max(0, self.num_samples - samples_done))

    def order(self, epoch: int) -> np.ndarray:
        """The order of the samples in ``epoch``."""
        if self.shuffle_seed is None:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.shuffle_seed, epoch]).permutation(self.num_samples)

    def batches(self):
        """An endless iterator of this rank's batches, from where the state
        stands (the epoch and the samples already trained on) on."""
        group = context.get()
        epoch = getattr(self.state, "epoch", 0)
        start = self.state.progress.resume_samples()
        global_batch = self.global_batch()
        # The last global batch, of the epoch being resumed and of whole epochs.
        for last in ((self.num_samples - start) % global_batch, self.num_samples % global_batch):
            if 0 < last < group.size:
                raise ValueError(
                    f"A global batch of {last} samples cannot be split among {group.size} "
                    f"ranks. Received: {self.num_samples} samples, "
                    f"batch_size={self.batch_size}")
        return self._generate(epoch, start, group.rank, group.size, global_batch)

    def _generate(self, epoch, start, rank, size, global_batch):
        while True:
            indices = self.order(epoch)[start:]
            for first in range(0, len(indices), global_batch):
                chunk = indices[first:first + global_batch]
                part = np.sort(chunk[rank * len(chunk) // size:(rank + 1) * len(chunk) // size])
                yield self._take(part)
            epoch += 1
            start = 0

    def _take(self, indices: np.ndarray):
        values = [a[indices] for a in self._arrays]
        if self._single:
            return values[0]
        if self._keys is not None:
            return dict(zip(self._keys, values))
        return tuple(values)
