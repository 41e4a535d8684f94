"""Sharded optimizer state (ZeRO-1) for ``DistributedOptimizer(shard_optimizer_state=True)``.

Every rank plans the same partition of the trainable variables
(``zero_partition.plan``: whole variables, or row blocks for element-wise
optimizers) and builds the wrapped optimizer on its own share only: the
variables it owns whole, and one *proxy* variable per row block it owns of a
split variable (the proxy holds those rows; the optimizer's slots are built
from it). A step then, on every rank, with the gradients already averaged
across ranks by the wrapper's usual allreduce:

1. unscales (``loss_scale_factor``) and clips (``clipnorm``, ``clipvalue``,
   ``global_clipnorm``) all the gradients exactly as the wrapped optimizer
   would, since every rank holds them all (so a global norm is the norm of
   every gradient, with no further collective);
2. copies each proxy's rows from its variable and applies the wrapped
   optimizer (clipping and unscaling off for that call) to the share;
3. exchanges the updated weights by a Sum allreduce per bucket of variables
   (at most the fusion threshold's bytes), in which each rank contributes its
   share and zeros elsewhere: ``x + 0 = x`` exactly, so every rank ends the
   step with bit for bit the weights of its owners, the same weights the
   unsharded optimizer computes. Within a traced step this is the collective
   every backend already runs natively (TensorFlow's kernel, JAX's FFI
   handler); the temporaries are a bucket's, not the model's.

The traffic is that of two allreduces (the gradients, the weights), one more
than without sharding; see docs/zero.md for the measurements.
"""

from __future__ import annotations

import contextlib
import math

import keras
from keras import ops

from keras_dist import _compat as compat
from keras_dist import _vocab
from keras_dist._keras import backends
from keras_dist._keras.gradients import to_dense
from keras_dist._keras.zero_partition import Piece, Tensor, plan
from keras_dist._runtime import context
from keras_dist.tensor import kinds
from keras_dist.tensor import ops as kd_ops

#: Optimizers whose update is element-wise (exact on any block of rows): only
#: these classes, not subclasses of them, have variables split.
ELEMENTWISE = tuple(
    getattr(keras.optimizers, name) for name in (
        "SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad", "Adadelta", "Ftrl",
        "Lion") if hasattr(keras.optimizers, name))


def _keras_class(optimizer) -> type:
    """``optimizer``'s class, past the backend's own versions of it (PyTorch's
    ``keras.src.backend.torch.optimizers.torch_adam.Adam`` is Keras's Adam)."""
    return next(c for c in type(optimizer).__mro__
                if not c.__module__.startswith("keras.src.backend."))


def _splittable(optimizer, variable) -> bool:
    return (_keras_class(optimizer) in ELEMENTWISE and variable.constraint is None
            and not getattr(variable, "overwrite_with_gradient", False)
            and len(variable.shape) >= 1)


def _tensor(optimizer, variable) -> Tensor:
    return Tensor(tuple(int(d) for d in variable.shape), _itemsize(variable.dtype),
                  _splittable(optimizer, variable))


def _itemsize(dtype) -> int:
    import numpy as np

    name = keras.backend.standardize_dtype(dtype)
    return 2 if name == "bfloat16" else np.dtype(name).itemsize


class Shards:
    """This rank's share of the optimizer state, and the step that applies it.

    Args:
        wrapper: the ``DistributedOptimizer`` (proxies are its variables).
        variables: the trainable variables, in the order every rank shares.
        rank, size: this rank and the number of ranks.
    """

    def __init__(self, wrapper, variables, rank: int, size: int):
        inner = wrapper.inner_optimizer
        self.rank, self.size = rank, size
        self.pieces: list[tuple[Piece, ...]] = plan(
            [_tensor(inner, v) for v in variables], size)
        self.own: list = []  # (variable index, piece, variable the inner optimizer updates)
        for index, (variable, pieces) in enumerate(zip(variables, self.pieces)):
            for piece in pieces:
                if piece.rank != rank:
                    continue
                if len(pieces) == 1:
                    self.own.append((index, piece, variable))
                    continue
                proxy = wrapper.add_variable(
                    shape=(piece.stop - piece.start, *variable.shape[1:]),
                    dtype=variable.dtype, initializer="zeros", aggregation="none",
                    name=variable.name)
                if not compat.uses_weight_decay(inner, variable):
                    compat.exclude_from_weight_decay(inner, proxy)
                self.own.append((index, piece, proxy))
        self.held = [target for _, _, target in self.own]
        #: The exchange's buckets: runs of consecutive variables of one dtype and
        #: at most the fusion threshold's bytes (a larger variable alone), so its
        #: temporaries are a bucket's, never the model's.
        self.buckets = _buckets(list(variables), context.get().config.fusion_threshold_bytes)
        #: Inner variables every rank holds alike (not slots of its share).
        self.replicated_inner = list(inner.variables)
        inner.build(self.held)

    def apply(self, inner, grads, variables) -> None:
        """Applies ``grads`` (averaged, one per variable, all of them) to this rank's
        share, then exchanges the updated weights so every rank holds all of them."""
        present = [i for i, g in enumerate(grads) if g is not None]
        grads = list(grads)
        if inner.loss_scale_factor is not None:
            for i in present:
                grads[i] = grads[i] / inner.loss_scale_factor
        for i, g in zip(present, compat.clip_gradients(inner, [grads[i] for i in present])):
            grads[i] = g
        owned_grads, owned_vars = [], []
        for index, piece, target in self.own:
            grad = grads[index]
            if grad is None:
                continue
            if target is not variables[index]:
                rows = slice(piece.start, piece.stop)
                target.assign(variables[index].value[rows])
                grad = to_dense(grad)[rows]
            owned_grads.append(grad)
            owned_vars.append(target)
        if owned_vars:
            with _unclipped(inner):
                inner.apply(owned_grads, owned_vars)
        else:  # nothing of this rank's share has a gradient: the step still counts
            inner.iterations.assign_add(1)
        self.exchange(variables)

    def exchange(self, variables) -> None:
        """Every rank's share of the weights to every rank: a Sum allreduce per bucket
        of variables, each rank contributing its share and zeros elsewhere.

        A bucket is one flat buffer made for the call (the rank's rows and
        zeros, concatenated), so the native op reduces in it and keeps no
        buffer of its own between steps; each variable takes its slice. A
        bucket is made once the previous bucket is reduced (in a traced
        TensorFlow step too: ``kinds.after``), so about two buckets of
        temporaries live at once. A variable this rank owns whole keeps its
        value (``x + 0 = x``): it is sent, not assigned.
        """
        if self.size == 1:
            return
        owned = {(index, piece.start): target for index, piece, target in self.own}
        previous: list = []
        for bucket in self.buckets:
            with kinds.after(previous):
                parts = [part for i in bucket
                         for part in self._contribution(variables[i], self.pieces[i], i, owned)]
                flat = (ops.concatenate(parts, axis=0) if len(parts) > 1
                        else backends.fresh(parts[0]))
                summed = backends.host_function(_sum_allreduce)([flat])[0]
            offset = 0
            for i in bucket:
                variable = variables[i]
                size = math.prod(int(d) for d in variable.shape)
                if not (len(self.pieces[i]) == 1 and (i, 0) in owned):
                    variable.assign(ops.reshape(summed[offset:offset + size], variable.shape))
                offset += size
            previous = [summed]

    @staticmethod
    def _contribution(variable, pieces, index, owned) -> list:
        """``variable``'s rows as this rank sends them, flat: its own, zeros elsewhere."""
        row = math.prod(int(d) for d in variable.shape[1:])
        parts = []
        for piece in pieces:
            target = owned.get((index, piece.start))
            if target is not None:
                parts.append(ops.reshape(target.value, (-1,)))
            else:
                rows = (piece.stop - piece.start) if len(variable.shape) else 1
                parts.append(ops.zeros((rows * row,), variable.dtype))
        return parts


def _nbytes(variable) -> int:
    return math.prod(int(d) for d in variable.shape) * _itemsize(variable.dtype)


def _buckets(variables: list, limit: int) -> list[list[int]]:
    """Indices of ``variables`` in runs of one dtype and at most ``limit`` bytes (a
    larger variable alone)."""
    buckets: list[list[int]] = []
    total, dtype = 0, None
    for index, variable in enumerate(variables):
        size = _nbytes(variable)
        if not buckets or total + size > limit or variable.dtype != dtype:
            buckets.append([])
            total, dtype = 0, variable.dtype
        buckets[-1].append(index)
        total += size
    return buckets


def _sum_allreduce(values: list) -> list:
    return kd_ops.grouped_allreduce(values, op=_vocab.Sum, name="sharded weights")


@contextlib.contextmanager
def _unclipped(inner):
    """The wrapped optimizer with no clipping and no loss-scale factor (done already)."""
    saved = inner.clipnorm, inner.clipvalue, inner.global_clipnorm, inner.loss_scale_factor
    inner.clipnorm = inner.clipvalue = inner.global_clipnorm = None
    inner.loss_scale_factor = None
    try:
        yield
    finally:
        (inner.clipnorm, inner.clipvalue, inner.global_clipnorm,
         inner.loss_scale_factor) = saved


def replicated_state(optimizer) -> list:
    """``optimizer``'s variables that every rank holds alike, for a broadcast:
    all its ``variables``, but for a ``DistributedOptimizer`` sharding its
    state, whose shares differ between ranks (``replicated_variables``)."""
    replicated = getattr(optimizer, "replicated_variables", None)
    return list(replicated()) if callable(replicated) else list(optimizer.variables)
