"""SyncBatchNormalization: batch statistics over the global batch of every rank."""

from __future__ import annotations

import keras
from keras import ops

from keras_dist import _compat as compat
from keras_dist import _vocab
from keras_dist._runtime import context
from keras_dist.tensor import ops as kd_ops


@keras.saving.register_keras_serializable(package="keras_dist")
class SyncBatchNormalization(compat.BatchNormalizationWithMoments):
    """Batch normalization whose training statistics cover every rank's batch.

    Takes the arguments of ``keras.layers.BatchNormalization``. In training,
    each rank sums its batch (shifted by the moving mean, which every rank
    shares, for precision) and the squares, and one allreduce per layer and
    step combines the sums of all ranks, so the mean and variance are those
    of the global batch, weighted by each rank's batch size (a rank may have a
    smaller last batch). The gradient flows through the allreduce (its
    gradient is the sum of the ranks' gradients). At size 1 it is
    ``BatchNormalization``. Inference uses the moving statistics, as usual.

    Raises:
        NotImplementedError: at size > 1 on a backend other than TensorFlow.
    """

    def batch_moments(self, inputs, mask):
        if context.get().size == 1:
            return super().batch_moments(inputs, mask)
        if keras.backend.backend() != "tensorflow":
            raise NotImplementedError(
                "SyncBatchNormalization reduces statistics across ranks on the TensorFlow "
                f"backend only. Received: KERAS_BACKEND={keras.backend.backend()}")
        axes = self.reduction_axes()
        shift = ops.cast(self.moving_mean, inputs.dtype)
        shape = [1] * len(inputs.shape)
        for axis in range(len(inputs.shape)):
            if axis not in axes:
                shape[axis] = inputs.shape[axis]
        centred = inputs - ops.reshape(shift, shape)
        if mask is None:
            weights = ops.ones_like(inputs[..., :1])
        else:
            weights = ops.cast(ops.expand_dims(mask, -1), inputs.dtype)
        weights = ops.broadcast_to(weights, ops.shape(inputs))
        local_sum = ops.sum(centred * weights, axes)
        local_squares = ops.sum(ops.square(centred) * weights, axes)
        local_count = ops.sum(weights, axes)
        total_sum, total_squares, count = _global_sum([local_sum, local_squares, local_count])
        count = ops.maximum(count, 1.0)
        offset = total_sum / count
        mean = shift + offset
        variance = ops.maximum(total_squares / count - ops.square(offset), 0.0)
        return mean, variance


def _global_sum(values: list) -> list:
    """Sum across ranks of TF tensors, differentiable (the gradient is summed too)."""
    import tensorflow as tf

    @tf.custom_gradient
    def summed(*xs):
        results = kd_ops.grouped_allreduce(list(xs), op=_vocab.Sum, name="sync_batch_norm")

        def gradient(*upstream):
            return kd_ops.grouped_allreduce(list(upstream), op=_vocab.Sum,
                                            name="sync_batch_norm_grad")

        return results, gradient

    return list(summed(*values))
