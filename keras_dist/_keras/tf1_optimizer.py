"""``DistributedOptimizer`` over a TensorFlow 1 optimizer (``tf.compat.v1.train``).

``keras_dist.DistributedOptimizer(opt)`` with a ``tf.compat.v1.train.Optimizer``
returns a ``TF1DistributedOptimizer``: itself a ``tf.compat.v1.train.Optimizer``
that holds the user's optimizer (composition, as the Keras wrapper does). Its
``compute_gradients`` reduces the gradients across ranks; ``apply_gradients``,
``get_slot``, ``get_slot_names`` and ``variables`` are the wrapped optimizer's,
so ``minimize`` (``compute_gradients`` then ``apply_gradients``) trains every
rank alike. It works in a TF1 graph (a session, ``MonitoredTrainingSession``)
and eagerly. Imported only when such an optimizer is given, so TensorFlow is
loaded already.
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from keras_dist import _vocab
from keras_dist._keras.gradients import GradientReduction, check_groups, to_dense
from keras_dist.tensor.compression import Compression


def _check_var_list(var_list) -> None:
    """Refuses Keras 3 variables, which a TF1 optimizer cannot update."""
    if var_list is None or callable(var_list):
        return
    keras_variables = [v for v in var_list if isinstance(v, keras.Variable)]
    if keras_variables:
        raise ValueError(
            "`var_list` of a tf.compat.v1.train optimizer must hold TensorFlow variables, "
            "not Keras 3 variables (leave `var_list` out: the graph's trainable variables "
            "include the Keras layers' own, or pass `[v.value for v in ...]`). Received: "
            f"{[v.path for v in keras_variables]}")


@dataclasses.dataclass
class _Accumulation:
    """One graph's state for ``backward_passes_per_step`` > 1: a count of the
    passes since the last communication and a running sum per variable, all
    local variables (not saved, not broadcast, set up by the session's local
    initialiser)."""

    counter: object
    sums: dict  # id(variable) -> (variable, its running sum)


class TF1DistributedOptimizer(tf.compat.v1.train.Optimizer):
    """A ``tf.compat.v1.train.Optimizer`` whose gradients are reduced across ranks.

    Made by ``keras_dist.DistributedOptimizer``, which takes the same
    arguments for Keras and TF1 optimizers (those below).

    Args:
        optimizer: the ``tf.compat.v1.train.Optimizer`` to wrap.
        op: ``keras_dist.Average`` (default) or another reduce op.
        compression: ``Compression.none`` or ``Compression.fp16``.
        backward_passes_per_step: gradients of this many steps are summed
            locally and reduced once; the wrapped optimizer applies them (and
            advances ``global_step``) on every that-many-th step only.
        average_aggregated_gradients: divide the local sums by
            ``backward_passes_per_step`` before reducing them.
        sparse_as_dense: reduce ``IndexedSlices`` gradients as dense tensors
            (otherwise their values and indices are allgathered).
        gradient_predivide_factor: with ``Average``, scale by ``1/f`` before
            the sum and by ``f/size`` after it.
        num_groups: Horovod's older spelling of ``groups`` as a number.
        groups: a whole number ``k`` (``k`` allreduces of consecutive
            gradients) or a list of lists of variables (one allreduce each).
        process_set: the ranks to reduce over (default: every rank).
        name: the optimizer's name (default ``"Distributed<Class>"``).
    """

    def __init__(self, optimizer, *, op=_vocab.Average, compression=Compression.none,
                 backward_passes_per_step: int = 1,
                 average_aggregated_gradients: bool = False, sparse_as_dense: bool = False,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                 process_set=None, name: str | None = None):
        if isinstance(optimizer, TF1DistributedOptimizer):
            raise ValueError("`optimizer` must not already be a DistributedOptimizer. "
                             f"Received: optimizer={optimizer.get_name()}")
        passes = backward_passes_per_step
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError("`backward_passes_per_step` must be an integer >= 1. "
                             f"Received: backward_passes_per_step={passes!r}")
        if passes > 1 and (groups is not None or num_groups):
            # The reduction then runs inside a `tf.cond`, where a TF1 graph does not
            # order several collectives: it must be one grouped allreduce.
            raise ValueError(
                "`groups`/`num_groups` and `backward_passes_per_step` > 1 do not go "
                "together with a tf.compat.v1.train optimizer. Received: "
                f"backward_passes_per_step={passes}, groups={groups!r}, "
                f"num_groups={num_groups!r}")
        self._reduction = GradientReduction(
            op=op, compression=compression, sparse_as_dense=bool(sparse_as_dense),
            gradient_predivide_factor=float(gradient_predivide_factor),
            groups=check_groups(groups, num_groups), process_set=process_set)
        super().__init__(use_locking=False,
                         name=name or f"Distributed{type(optimizer).__name__}")
        self._optimizer = optimizer
        self._passes = passes
        self._average_aggregated = bool(average_aggregated_gradients)
        self._accumulations: dict = {}  # per graph (None: eager)

    @property
    def inner_optimizer(self):
        """The wrapped ``tf.compat.v1.train.Optimizer``."""
        return self._optimizer

    def __repr__(self) -> str:
        # What Keras prints when this is given to `model.compile`, which it refuses.
        return (f"<DistributedOptimizer of a tf.compat.v1.train optimizer "
                f"({type(self._optimizer).__name__}), for TF1 graphs and sessions: a Keras 3 "
                "model compiles with a Keras 3 optimizer, e.g. "
                "kd.DistributedOptimizer(keras.optimizers.Adam())>")

    # -- the wrapped optimizer's own API ------------------------------------

    def get_slot(self, var, name):
        return self._optimizer.get_slot(var, name)

    def get_slot_names(self):
        return self._optimizer.get_slot_names()

    def variables(self):
        return self._optimizer.variables()

    # -- gradients -------------------------------------------------------------

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's ``(gradient, variable)`` pairs, the gradients
        reduced across ranks (takes ``compute_gradients``'s arguments).

        With ``backward_passes_per_step`` > 1 they are summed locally first
        and reduced every that many calls; the other calls return the sums
        (which ``apply_gradients`` then does not apply).
        """
        _check_var_list(kwargs["var_list"] if "var_list" in kwargs
                        else args[1] if len(args) > 1 else None)
        pairs = list(self._optimizer.compute_gradients(*args, **kwargs))
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        if self._passes == 1:
            reduced = self._reduction.reduce(grads, variables)
        else:
            reduced = self._accumulate(grads, variables)
        return list(zip(reduced, variables))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None, **kwargs):
        """The wrapped optimizer's ``apply_gradients``, as given.

        Gradients are reduced by ``compute_gradients`` (and ``minimize``);
        pass those, changed as you like (clipped, scaled), here. With
        ``backward_passes_per_step`` > 1 they are applied on a communication
        step only, and ``global_step`` counts the steps applied.
        """
        if self._passes == 1:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                                   name=name, **kwargs)
        grads_and_vars = list(grads_and_vars)
        state = self._accumulation(create=False)
        if state is None:
            raise ValueError(
                "With backward_passes_per_step > 1, `apply_gradients` takes the gradients "
                "this optimizer's `compute_gradients` returned in this graph. Received: "
                "gradients from elsewhere")
        grads = [g for g, _ in grads_and_vars if g is not None]
        with tf.control_dependencies(grads):  # after this step's count is updated
            communicated = tf.equal(state.counter.read_value(), 0)

        def apply():
            with tf.control_dependencies([self._optimizer.apply_gradients(
                    grads_and_vars, global_step=global_step, name=name, **kwargs)]):
                return tf.constant(True)

        applied = tf.cond(communicated, apply, lambda: tf.constant(False))
        return None if tf.executing_eagerly() else applied.op

    def _accumulation(self, create: bool) -> _Accumulation | None:
        """The accumulation state of the graph being built (made when ``create``)."""
        with tf.init_scope():
            key = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        if key not in self._accumulations and create:
            with tf.init_scope():
                counter = _local_variable(tf.zeros((), tf.int32), "backward_passes")
            self._accumulations[key] = _Accumulation(counter=counter, sums={})
        return self._accumulations.get(key)

    def _accumulate(self, grads: list, variables: list) -> list:
        """This step's gradients summed with the previous passes' and, on every
        ``backward_passes_per_step``-th call, reduced (the sums then restart)."""
        state = self._accumulation(create=True)
        present = [i for i, g in enumerate(grads) if g is not None]
        for i in present:
            if id(variables[i]) not in state.sums:
                with tf.init_scope():
                    total = _local_variable(tf.zeros(variables[i].shape, grads[i].dtype),
                                            "gradient_sum")
                state.sums[id(variables[i])] = (variables[i], total)
        totals = [state.sums[id(variables[i])][1] for i in present]
        sums = [t.read_value() + to_dense(grads[i]) for t, i in zip(totals, present)]
        count = state.counter.read_value() + 1
        communicating = tf.equal(count, self._passes)
        steps = float(self._passes)

        def communicate():
            summed = [None] * len(grads)
            for i, total in zip(present, sums):
                summed[i] = total / steps if self._average_aggregated else total
            reduced = self._reduction.reduce(summed, variables)
            return [tf.convert_to_tensor(reduced[i]) for i in present]

        values = tf.cond(communicating, communicate, lambda: [tf.identity(s) for s in sums])
        with tf.control_dependencies(values):  # the sums are read before they change
            updates = [t.assign(tf.where(communicating, tf.zeros_like(s), s))
                       for t, s in zip(totals, sums)]
            updates.append(state.counter.assign(tf.where(communicating, 0, count)))
        result = [None] * len(grads)
        with tf.control_dependencies(updates):
            for i, value in zip(present, values):
                result[i] = tf.identity(value)
        return result


def _local_variable(initial_value, name: str):
    """A variable of this rank alone: in a TF1 graph, in the local-variables
    collection (the session's local initialiser sets it; savers and
    ``broadcast_global_variables`` leave it)."""
    return tf.compat.v1.Variable(
        initial_value, trainable=False, name=name, use_resource=True,
        collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
