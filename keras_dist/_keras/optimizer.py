"""DistributedOptimizer: averages gradients across ranks before they are applied."""

from __future__ import annotations

import sys

import keras
from keras import ops

from keras_dist import _compat as compat
from keras_dist import _vocab
from keras_dist._keras import backends, zero, zero_saving
from keras_dist._keras.callbacks import backup_and_restore  # noqa: F401  (see its docstring)
from keras_dist._keras.gradients import (
    GradientReduction,
    check_groups,
    check_local_layers,
    to_dense,
)
from keras_dist._runtime import context
from keras_dist.tensor import ops as kd_ops

_COMPRESSIONS = {"none": kd_ops.Compression.none, "fp16": kd_ops.Compression.fp16}


def _compression_name(compression) -> str:
    for name, value in _COMPRESSIONS.items():
        if compression is value:
            return name
    raise ValueError(
        "`compression` must be keras_dist.Compression.none or keras_dist.Compression.fp16. "
        f"Received: compression={compression!r}"
    )


def _accumulation(optimizer, passes, average) -> tuple[int, bool]:
    """``(backward_passes_per_step, average_aggregated_gradients)`` in force.

    A wrapped optimizer's own ``gradient_accumulation_steps`` is taken over
    (and turned off on it): the wrapper accumulates, averages and
    communicates once every that many steps, as Keras would apply.
    """
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(
            "`backward_passes_per_step` must be an integer >= 1. "
            f"Received: backward_passes_per_step={passes!r}"
        )
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    if not steps:
        return passes, bool(average)
    if passes not in (1, steps):
        raise ValueError(
            "Pass `backward_passes_per_step` or the wrapped optimizer's "
            "`gradient_accumulation_steps`, not both. Received: "
            f"backward_passes_per_step={passes}, gradient_accumulation_steps={steps}"
        )
    optimizer.gradient_accumulation_steps = None
    return steps, True


class _LocalState:
    """The wrapper's Python-only state, kept out of Keras's variable tracking."""

    def __init__(self):
        self.variables: set[int] = set()  # ids of registered local variables
        self.layers: list = []  # local layers, their weights read at each step
        self.pending: tuple | None = None  # gradients `compute_gradients` reduced
        self.shards: zero.Shards | None = None  # this rank's share (shard_optimizer_state)


@keras.saving.register_keras_serializable(package="keras_dist")
class DistributedOptimizer(keras.optimizers.LossScaleOptimizer):
    """Wraps an optimizer so that gradients are reduced across ranks first.

    Every gradient of a step goes through one grouped allreduce, in the order
    of the trainable variables (identical on every rank), before the wrapped
    optimizer clips, decays and applies them. At size 1 no collective runs.

    The class derives from `keras.optimizers.LossScaleOptimizer` so that
    `compile()` never wraps it in a second loss-scale optimizer whose finite
    check would run on each rank's own gradients. It scales the loss itself
    when the dtype policy is `"mixed_float16"` (or `loss_scale=True`), and its
    finite check runs on the reduced gradients, so all ranks skip or apply a
    step together. Otherwise it adds no loss scaling.

    Args:
        optimizer: the `keras.optimizers.Optimizer` to wrap. A
            `LossScaleOptimizer` is unwrapped and its scaling taken over.
        op: `keras_dist.Average` (default) or `keras_dist.Sum` (any reduce op
            for dense gradients).
        compression: `keras_dist.Compression.none` or `Compression.fp16`
            (gradients travel as float16 and get their dtype back).
        backward_passes_per_step: gradients of this many steps are summed
            locally and communicated once; the wrapped optimizer applies them
            every that many steps. `iterations` still advances on every step,
            as with Keras's own `gradient_accumulation_steps` (which, set on
            the wrapped optimizer, is taken over: the wrapper then accumulates,
            averages, and communicates once every that many steps).
        average_aggregated_gradients: divide the locally summed gradients by
            `backward_passes_per_step` before they are applied.
        sparse_as_dense: densify `IndexedSlices` gradients (embeddings) and
            allreduce them; by default their values and indices are
            allgathered.
        gradient_predivide_factor: with `op=Average`, gradients are multiplied
            by `1/f` before the sum and by `f/size` after it.
        num_groups: Horovod's older spelling of `groups` as a number.
        groups: a whole number `k` (the gradients go in `k` allreduces of
            consecutive gradients) or a list of lists of variables (each
            list one allreduce; variables in no list one allreduce each).
        process_set: the ranks gradients are reduced over (default: every
            rank); on a rank outside the set they stay its own. Not saved
            with the model.
        scale_local_gradients: divide the gradients of variables registered
            with `register_local_var` by the number of ranks (as Horovod).
        loss_scale: `None` (default) scales the loss dynamically exactly when
            the global dtype policy is `"mixed_float16"` when the optimizer is
            built; `True` or `False` force it on or off.
        initial_scale: first loss scale, when loss scaling.
        dynamic_growth_steps: finite steps after which the loss scale doubles.
        shard_optimizer_state: keep the wrapped optimizer's state (its slot
            variables) on each rank for its share of the trainable variables
            only (ZeRO-1): each rank updates its share and the updated weights
            are exchanged, so every rank ends each step with the weights the
            unsharded optimizer computes. Element-wise optimizers (SGD, Adam,
            AdamW, Adamax, Nadam, RMSprop, Adagrad, Adadelta, Ftrl, Lion) may
            have a variable's rows split between ranks; any other optimizer
            keeps whole variables. Not with `process_set` or local variables.
            See docs/zero.md.
        name: the optimizer's name.

    A TensorFlow 1 optimizer (``tf.compat.v1.train.Optimizer``) is wrapped
    for TF1 graphs and sessions instead: the result is a
    ``tf.compat.v1.train.Optimizer`` whose ``compute_gradients`` (and so
    ``minimize``) reduces the gradients, with the options above but the
    Keras-only ones (``scale_local_gradients``, loss scaling); see
    ``keras_dist._keras.tf1_optimizer``.

    Example:

    ```python
    opt = kd.DistributedOptimizer(keras.optimizers.SGD(0.01 * kd.size()))
    model.compile(optimizer=opt, loss="mse")
    ```
    """

    def __new__(cls, optimizer=None, *args, **kwargs):
        # TensorFlow is loaded wherever a TF1 optimizer exists: it is never imported here.
        tf = sys.modules.get("tensorflow")
        if tf is not None and isinstance(optimizer, tf.compat.v1.train.Optimizer):
            from keras_dist._keras.tf1_optimizer import TF1DistributedOptimizer

            return TF1DistributedOptimizer(optimizer, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        optimizer,
        *,
        op=_vocab.Average,
        compression=kd_ops.Compression.none,
        backward_passes_per_step: int = 1,
        average_aggregated_gradients: bool = False,
        sparse_as_dense: bool = False,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups=None,
        process_set=None,
        scale_local_gradients: bool = True,
        loss_scale: bool | None = None,
        initial_scale: float = 2.0**15,
        dynamic_growth_steps: int = 2000,
        shard_optimizer_state: bool = False,
        name: str | None = None,
    ):
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError(
                "`optimizer` must not already be a DistributedOptimizer. "
                f"Received: optimizer={optimizer.name}"
            )
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            initial_scale = optimizer.initial_scale
            dynamic_growth_steps = optimizer.dynamic_growth_steps
            loss_scale = True
            optimizer = optimizer.inner_optimizer
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise ValueError(
                "`optimizer` must be a keras.optimizers.Optimizer. "
                f"Received: optimizer={optimizer!r}"
            )
        reduction = GradientReduction(
            op=op, compression=compression, sparse_as_dense=bool(sparse_as_dense),
            gradient_predivide_factor=float(gradient_predivide_factor),
            groups=check_groups(groups, num_groups), process_set=process_set,
            scale_local_gradients=bool(scale_local_gradients))
        if not isinstance(shard_optimizer_state, bool):
            raise ValueError("`shard_optimizer_state` must be True or False. Received: "
                             f"shard_optimizer_state={shard_optimizer_state!r}")
        if shard_optimizer_state and process_set is not None:
            raise ValueError(
                "`shard_optimizer_state=True` shards the optimizer state over every rank "
                "of the job and cannot be combined with `process_set`; pass process_set="
                f"None. Received: process_set={process_set!r}")
        backward_passes_per_step, average_aggregated_gradients = _accumulation(
            optimizer, backward_passes_per_step, average_aggregated_gradients)
        backends.check_supported()
        if shard_optimizer_state and backward_passes_per_step > 1 and backends.name() == "jax":
            # The gradients' allreduce sits in a traced cond there, and the
            # weights' exchange after it cannot be ordered after a collective
            # of a branch.
            raise NotImplementedError(
                "`shard_optimizer_state=True` on the JAX backend does not support "
                "backward_passes_per_step or gradient_accumulation_steps > 1 yet; use one "
                "of them. Received: backward_passes_per_step="
                f"{backward_passes_per_step}")
        if backends.name() == "tensorflow":
            backends.refuse_tf1_graph(f"DistributedOptimizer({type(optimizer).__name__})")
            compat.turn_off_auto_jit_compile_when(_xla_conflict)
        # LossScaleOptimizer.__init__ would disable the inner optimizer's own
        # `loss_scale_factor`; only the base initialiser is wanted here.
        keras.optimizers.Optimizer.__init__(
            self, learning_rate=0.0, name=name or f"distributed_{optimizer.name}"
        )
        self.inner_optimizer = optimizer
        self._reduction = reduction
        # Untracked Python state: local variables and the gradients the last
        # `compute_gradients` call already reduced (see `apply`).
        self._local = _LocalState()
        self.op = op
        self.compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.average_aggregated_gradients = bool(average_aggregated_gradients)
        self.sparse_as_dense = bool(sparse_as_dense)
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.process_set = process_set
        self.scale_local_gradients = bool(scale_local_gradients)
        self.loss_scale = loss_scale
        self.initial_scale = initial_scale
        self.dynamic_growth_steps = dynamic_growth_steps
        self.shard_optimizer_state = shard_optimizer_state

    # -- loss scaling ------------------------------------------------------

    def _uses_loss_scale(self) -> bool:
        if self.loss_scale is None:
            self.loss_scale = keras.config.dtype_policy().name == "mixed_float16"
            if self.loss_scale:
                self.inner_optimizer.loss_scale_factor = None
        return self.loss_scale

    def scale_loss(self, loss):
        if self._uses_loss_scale():
            return super().scale_loss(loss)
        return self.inner_optimizer.scale_loss(loss)

    # -- state -------------------------------------------------------------

    @compat.no_automatic_dependency_tracking
    def build(self, var_list):
        if self._uses_loss_scale():
            self.step_counter = self.add_variable(
                shape=(), dtype="int", initializer="zeros", aggregation="none",
                name="step_counter",
            )
            self.dynamic_scale = self.add_variable(
                shape=(), dtype="float32",
                initializer=keras.initializers.Constant(self.initial_scale),
                aggregation="none", name="dynamic_scale",
            )
        if self.backward_passes_per_step > 1:
            self.local_steps = self.add_variable(
                shape=(), dtype="int", initializer="zeros", aggregation="none",
                name="local_steps",
            )
            self.gradient_accumulators = [
                self.add_variable_from_reference(v, name="gradient_accumulator")
                for v in var_list
            ]
        if self.shard_optimizer_state:
            group = context.get()
            self._local.shards = zero.Shards(self, list(var_list), group.rank, group.size)
            zero_saving.install(self, self._local.shards)
        else:
            self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)

    def replicated_variables(self) -> list:
        """The optimizer's variables that every rank holds alike (what a broadcast
        of the optimizer's state may send): all of ``variables``, except with
        ``shard_optimizer_state``, where each rank's share is its own."""
        shards = self._local.shards
        if shards is None:
            return list(self.variables)
        proxies = {id(target) for _, _, target in shards.own}
        return ([v for v in self._variables if id(v) not in proxies]
                + list(shards.replicated_inner))

    def save_own_variables(self, store):
        """Keras's save of the optimizer's variables; sharding, the whole state in the
        unsharded layout, gathered from every rank (``kd.save_model``; see
        ``zero_saving``): a save on one rank alone raises at once."""
        if self._local.shards is None:
            super().save_own_variables(store)
        else:
            zero_saving.save_part(self, "wrapper", store)

    def load_own_variables(self, store):
        """Keras's load of the optimizer's variables; sharding, this rank's share of a
        file in the unsharded layout (written by any number of ranks)."""
        if self._local.shards is None:
            super().load_own_variables(store)
        else:
            zero_saving.load_part(self, "wrapper", store)

    def finalize_variable_values(self, var_list):
        shards = self._local.shards
        if shards is None:
            self.inner_optimizer.finalize_variable_values(var_list)
        elif self.inner_optimizer.use_ema:
            # Each rank overwrites its share with its averages; the exchange
            # gives every rank all of them.
            self.inner_optimizer.finalize_variable_values(shards.held)
            shards.exchange(compat.built_variables(self))

    # -- local variables -------------------------------------------------

    def register_local_var(self, var) -> None:
        """Marks ``var`` as local to this rank: its gradient is not reduced.

        With ``scale_local_gradients`` (default) the gradient is divided by
        the number of ranks instead.
        """
        _refuse_local_when_sharded(self)
        self._local.variables.add(id(var))

    def _local_ids(self) -> set[int]:
        ids = set(self._local.variables)
        for layer in self._local.layers:
            ids.update(id(v) for v in layer.trainable_weights)
        return ids

    # -- the step ----------------------------------------------------------

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When passing `grads` without `variables`, the optimizer must already "
                    "be built. Call `optimizer.build(trainable_variables)` first."
                )
            trainable_variables = compat.built_variables(self)
        else:
            trainable_variables = list(trainable_variables)
            if not self.built:
                with keras.name_scope(self.name, caller=self):
                    self.build(trainable_variables)
                self.built = True
        if not grads:
            return
        if len(grads) != len(trainable_variables):
            raise ValueError(
                "`grads` and `trainable_variables` must have the same length. "
                f"Received: {len(grads)} gradients, {len(trainable_variables)} variables"
            )
        pending, self._local.pending = self._local.pending, None
        if pending is None or len(pending) != len(grads) or any(
                g is not p for g, p in zip(grads, pending)):
            grads = self._aggregate(grads, trainable_variables)
        self._apply_or_count(grads, trainable_variables)

    def _aggregate(self, grads, trainable_variables):
        """This step's gradients as they are to be applied.

        Reduced across ranks; with ``backward_passes_per_step`` > 1, first
        summed locally, and reduced (and the sums reset) on every k-th step
        only, the other steps returning the running sums.
        """
        self._check_not_in_xla()
        if self.backward_passes_per_step == 1:
            return self._reduce(grads, trainable_variables)
        steps = self.backward_passes_per_step
        accumulators = [
            self.gradient_accumulators[compat.variable_index(self, v)]
            for v in trainable_variables
        ]
        present = [i for i, g in enumerate(grads) if g is not None]
        # New values are computed first and assigned after the branch, so the
        # branches stay free of assignments (JAX traces them separately).
        sums = [accumulator.value for accumulator in accumulators]
        for i in present:
            sums[i] = sums[i] + ops.cast(to_dense(grads[i]), accumulators[i].dtype)
        local = self.local_steps.value + 1
        communicating = ops.equal(local % steps, 0)

        def communicate():
            summed = [sums[i] if i in present else None for i in range(len(grads))]
            if self.average_aggregated_gradients:
                summed = [None if a is None else a / steps for a in summed]
            reduced = self._reduce(summed, trainable_variables)
            return [ops.convert_to_tensor(reduced[i]) for i in present]

        def running_sums():
            return [ops.copy(sums[i]) for i in present]

        values = ops.cond(communicating, communicate, running_sums)
        for accumulator, total in zip(accumulators, sums):
            accumulator.assign(ops.where(communicating, ops.zeros_like(total), total))
        self.local_steps.assign(ops.where(communicating, ops.zeros_like(local), local))
        result = [None] * len(grads)
        for i, value in zip(present, values):
            result[i] = value
        return result

    def _apply_or_count(self, grads, trainable_variables):
        """Applies ``grads`` on a communication step; otherwise only counts the step."""
        if self.backward_passes_per_step == 1:
            self._apply_reduced(grads, trainable_variables)
            return
        communicating = ops.equal(self.local_steps, 0)
        if backends.name() == "jax" or self._local.shards is not None:
            # No assignment inside a traced branch: apply on every step (the
            # inner optimizer's `iterations` counts it), then keep the old
            # values of everything else where this step does not communicate.
            # (Sharded, on every backend: the weights' exchange in a branch of
            # TensorFlow's cond fails to trace.)
            kept = [v for v in list(trainable_variables) + list(self.inner_optimizer.variables)
                    if v is not self.inner_optimizer.iterations]
            if self._local.shards is not None and self._uses_loss_scale():
                kept += [self.step_counter, self.dynamic_scale]
            before = [ops.copy(v.value) for v in kept]  # a snapshot, not the variable
            self._apply_reduced(grads, trainable_variables)
            for variable, old in zip(kept, before):
                variable.assign(ops.where(communicating, variable.value, old))
            return

        def count():
            self.iterations.assign_add(1)

        ops.cond(communicating, lambda: self._apply_reduced(grads, trainable_variables), count)

    def _reduces(self) -> bool:
        """Whether the step reduces gradients (not at size 1, unless told to)."""
        return (self._reduction.span()[0] > 1
                or not context.get().config.size_one_shortcut)

    def _check_not_in_xla(self):
        if self._reduces() and compat.in_xla_context():
            raise RuntimeError(
                "DistributedOptimizer cannot run inside an XLA-compiled step on TensorFlow "
                "(its allreduce is a host call XLA cannot compile): compile the model with "
                "jit_compile=False or \"auto\", or pass a keras_dist callback (e.g. "
                "BroadcastGlobalVariablesCallback) to fit(), which turns XLA off for the "
                "step. Received: jit_compile=True"
            )

    def _reduce(self, grads, trainable_variables):
        """Reduces ``grads`` across ranks: dense ones in one grouped allreduce per group."""
        return backends.host_function(self._reduction.reduce)(
            grads, trainable_variables, self._local_ids())

    def _apply_reduced(self, grads, trainable_variables):
        if self._local.shards is not None:
            self._apply_sharded(grads, trainable_variables)
        elif self._uses_loss_scale():
            compat.loss_scale_apply(self, grads, trainable_variables)
        else:
            self.inner_optimizer.apply(grads, trainable_variables)

    def _apply_sharded(self, grads, trainable_variables):
        """This rank's share updated and the weights exchanged (``zero.Shards``).

        With loss scaling, every backend takes the same route, with no
        assignment inside a branch (which JAX cannot trace): the step is
        applied, then every variable it changed gets its old value back where
        the gradients are not finite, and the scale is updated as
        ``LossScaleOptimizer`` does. The reduced gradients are the same on
        every rank, so all ranks skip or apply a step together.
        """
        shards, inner = self._local.shards, self.inner_optimizer
        if not self._uses_loss_scale():
            shards.apply(inner, grads, trainable_variables)
            return
        finite = self.check_finite(grads)
        scale = ops.copy(self.dynamic_scale.value)
        unscaled = [None if g is None else ops.divide(to_dense(g), scale) for g in grads]
        changed = list(trainable_variables) + list(inner.variables)
        before = [ops.copy(v.value) for v in changed]
        shards.apply(inner, unscaled, trainable_variables)
        for variable, old in zip(changed, before):
            variable.assign(ops.where(finite, variable.value, old))
        counter = ops.copy(self.step_counter.value)
        grow = ops.equal(counter, self.dynamic_growth_steps - 1)
        self.step_counter.assign(ops.where(
            finite, ops.where(grow, ops.zeros_like(counter), counter + 1),
            ops.zeros_like(counter)))
        self.dynamic_scale.assign(ops.where(
            finite, ops.where(grow, scale * 2.0, scale), scale * 0.5))

    # -- gradients computed by the optimizer (Horovod's Keras 2 API) -------

    def compute_gradients(self, loss, var_list, tape=None):
        """Gradients of ``loss`` reduced across ranks, as ``(gradient, variable)`` pairs.

        ``loss`` is a tensor recorded on ``tape`` or a callable computing it.
        With ``backward_passes_per_step`` > 1 the gradients are accumulated
        as in ``apply``. Passing the returned pairs to ``apply_gradients``
        applies them without reducing them again.
        """
        return self._compute_gradients(loss, var_list, tape=tape)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        import tensorflow as tf

        tape = tf.GradientTape() if tape is None else tape
        if callable(var_list):
            var_list = var_list()
        var_list = list(var_list)
        if callable(loss):
            with tape:
                tape.watch(var_list)
                loss = loss()
        grads = tape.gradient(loss, var_list, grad_loss)
        return list(zip(self._reduce_computed(grads, var_list), var_list))

    def get_gradients(self, loss, params):
        """The wrapped optimizer's ``get_gradients(loss, params)``, reduced across ranks."""
        getter = getattr(self.inner_optimizer, "get_gradients", None)
        if getter is None:
            raise AttributeError(
                f"{type(self.inner_optimizer).__name__} has no `get_gradients`: compute the "
                "gradients with a tape and pass them to `apply`."
            )
        params = list(params)
        return self._reduce_computed(list(getter(loss, params)), params)

    def _reduce_computed(self, grads, var_list):
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(var_list)
            self.built = True
        reduced = self._aggregate(list(grads), var_list)
        self._local.pending = tuple(reduced)
        return reduced

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        if self._uses_loss_scale() and self._local.shards is None:
            if self.backward_passes_per_step > 1:
                raise NotImplementedError(
                    "DistributedOptimizer on the JAX backend does not support loss scaling "
                    "(mixed_float16) together with backward_passes_per_step > 1; use "
                    "mixed_bfloat16, or one of them. Received: backward_passes_per_step="
                    f"{self.backward_passes_per_step}, loss scaling on")
            # (JAX) Keras's stateless loss-scale step on the reduced gradients:
            # its finite check then agrees on every rank, and no variable is
            # assigned inside a traced branch.
            grads = self._reduce(list(grads), compat.built_variables(self))
            return keras.optimizers.LossScaleOptimizer.stateless_apply(
                self, optimizer_variables, grads, trainable_variables)
        # LossScaleOptimizer's own version would bypass `apply`, hence the allreduce.
        return keras.optimizers.Optimizer.stateless_apply(
            self, optimizer_variables, grads, trainable_variables
        )

    # -- serialization -----------------------------------------------------

    def get_config(self):
        groups = self._reduction.groups
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "op": self.op.value,
            "compression": _compression_name(self.compression),
            "backward_passes_per_step": self.backward_passes_per_step,
            "average_aggregated_gradients": self.average_aggregated_gradients,
            "sparse_as_dense": self.sparse_as_dense,
            "gradient_predivide_factor": self.gradient_predivide_factor,
            # Lists of variables and process sets belong to a session, not a file.
            "groups": groups if isinstance(groups, int) else None,
            "scale_local_gradients": self.scale_local_gradients,
            "loss_scale": self.loss_scale,
            "initial_scale": self.initial_scale,
            "dynamic_growth_steps": self.dynamic_growth_steps,
            "shard_optimizer_state": self.shard_optimizer_state,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        optimizer = keras.saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        config["op"] = _vocab.ReduceOp(config["op"])
        config["compression"] = _COMPRESSIONS[config["compression"]]
        return cls(optimizer, **config)


def PartialDistributedOptimizer(optimizer, *, local_layers=None, **kwargs):  # noqa: N802
    """A ``DistributedOptimizer`` that leaves the gradients of ``local_layers`` local.

    The layers' trainable weights (read at every step, so layers built
    later count too) keep each rank's own gradients, divided by the number
    of ranks unless ``scale_local_gradients=False``.

    Args:
        optimizer: the ``keras.optimizers.Optimizer`` to wrap.
        local_layers: a Keras layer or a list of them.
        **kwargs: as for ``DistributedOptimizer``.
    """
    local_layers = check_local_layers(local_layers)
    wrapped = DistributedOptimizer(optimizer, **kwargs)
    if not isinstance(wrapped, DistributedOptimizer):
        raise ValueError("`optimizer` of PartialDistributedOptimizer must be a Keras 3 "
                         f"optimizer. Received: optimizer={type(optimizer).__name__}")
    if local_layers:
        _refuse_local_when_sharded(wrapped)
    wrapped._local.layers.extend(local_layers)
    return wrapped


def _refuse_local_when_sharded(optimizer) -> None:
    if optimizer.shard_optimizer_state:
        raise ValueError(
            "Local variables (register_local_var, PartialDistributedOptimizer's "
            "local_layers) differ between ranks and cannot have their optimizer state "
            "sharded; pass shard_optimizer_state=False. Received: "
            "shard_optimizer_state=True")


def _xla_conflict(model) -> str | None:
    """Why ``model``'s ``jit_compile="auto"`` must resolve to False on TensorFlow
    (asked only where Keras would turn XLA on: TensorFlow sees a GPU), or None:
    its optimizer is a ``DistributedOptimizer`` that reduces, which XLA cannot
    compile. A plain ``compile``/``fit`` script then trains without XLA. The
    notice is rank 0's; other ranks turn XLA off silently (``""``)."""
    optimizer = getattr(model, "optimizer", None)
    while optimizer is not None and not isinstance(optimizer, DistributedOptimizer):
        optimizer = getattr(optimizer, "inner_optimizer", None)
    if optimizer is None or not context.is_initialized() or not optimizer._reduces():
        return None
    if context.get().rank != 0:
        return ""
    return ("keras_dist: XLA (jit_compile=\"auto\") is off for the train step on "
            "TensorFlow: DistributedOptimizer's allreduce is a host call that XLA cannot "
            "compile.")
