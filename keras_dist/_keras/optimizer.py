"""DistributedOptimizer: averages gradients across ranks before they are applied."""

from __future__ import annotations

import keras
from keras import ops

from keras_dist import _vocab
from keras_dist._keras import compat
from keras_dist._keras.gradients import GradientReduction, to_dense
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
            every that many steps.
        average_aggregated_gradients: divide the locally summed gradients by
            `backward_passes_per_step` before communicating.
        sparse_as_dense: densify `IndexedSlices` gradients (embeddings) and
            allreduce them; by default their values and indices are
            allgathered.
        gradient_predivide_factor: with `op=Average`, gradients are multiplied
            by `1/f` before the sum and by `f/size` after it.
        loss_scale: `None` (default) scales the loss dynamically exactly when
            the global dtype policy is `"mixed_float16"` when the optimizer is
            built; `True` or `False` force it on or off.
        initial_scale: first loss scale, when loss scaling.
        dynamic_growth_steps: finite steps after which the loss scale doubles.
        name: the optimizer's name.

    Example:

    ```python
    opt = kd.DistributedOptimizer(keras.optimizers.SGD(0.01 * kd.size()))
    model.compile(optimizer=opt, loss="mse")
    ```
    """

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
        loss_scale: bool | None = None,
        initial_scale: float = 2.0**15,
        dynamic_growth_steps: int = 2000,
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
        kd_ops._check_op(op)
        _compression_name(compression)
        if isinstance(backward_passes_per_step, bool) or not isinstance(
            backward_passes_per_step, int
        ) or backward_passes_per_step < 1:
            raise ValueError(
                "`backward_passes_per_step` must be an integer >= 1. "
                f"Received: backward_passes_per_step={backward_passes_per_step!r}"
            )
        if gradient_predivide_factor <= 0:
            raise ValueError(
                "`gradient_predivide_factor` must be > 0. "
                f"Received: gradient_predivide_factor={gradient_predivide_factor}"
            )
        if gradient_predivide_factor != 1.0 and op is not _vocab.Average:
            raise ValueError(
                "`gradient_predivide_factor` needs op=keras_dist.Average. "
                f"Received: op={op}, gradient_predivide_factor={gradient_predivide_factor}"
            )
        # LossScaleOptimizer.__init__ would disable the inner optimizer's own
        # `loss_scale_factor`; only the base initialiser is wanted here.
        keras.optimizers.Optimizer.__init__(
            self, learning_rate=0.0, name=name or f"distributed_{optimizer.name}"
        )
        self.inner_optimizer = optimizer
        self.op = op
        self.compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.average_aggregated_gradients = bool(average_aggregated_gradients)
        self.sparse_as_dense = bool(sparse_as_dense)
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.loss_scale = loss_scale
        self.initial_scale = initial_scale
        self.dynamic_growth_steps = dynamic_growth_steps

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
        self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)

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
        if context.get().size > 1 and compat.in_xla_context():
            raise RuntimeError(
                "DistributedOptimizer cannot run inside an XLA-compiled step "
                "(jit_compile=True): its collectives are host calls that XLA cannot "
                "compile. Compile the model with jit_compile=False, or pass a "
                "keras_dist callback (e.g. BroadcastGlobalVariablesCallback) to fit(), "
                "which turns XLA off for the train step."
            )
        if self.backward_passes_per_step == 1:
            self._apply_reduced(self._reduce(grads), trainable_variables)
        else:
            self._accumulate(grads, trainable_variables)

    def _accumulate(self, grads, trainable_variables):
        steps = self.backward_passes_per_step
        accumulators = [
            self.gradient_accumulators[compat.variable_index(self, v)]
            for v in trainable_variables
        ]
        for grad, accumulator in zip(grads, accumulators):
            if grad is not None:
                accumulator.assign_add(ops.cast(to_dense(grad), accumulator.dtype))
        self.local_steps.assign_add(1)

        def communicate():
            summed = [
                None if g is None
                else (a.value / steps if self.average_aggregated_gradients else a.value)
                for g, a in zip(grads, accumulators)
            ]
            self._apply_reduced(self._reduce(summed), trainable_variables)
            for accumulator in accumulators:
                accumulator.assign(ops.zeros_like(accumulator.value))

        ops.cond(ops.equal(self.local_steps % steps, 0), communicate, lambda: None)

    def _reduce(self, grads):
        """Reduces ``grads`` across ranks: dense ones in one grouped allreduce."""
        reduction = GradientReduction(
            op=self.op, compression=self.compression, sparse_as_dense=self.sparse_as_dense,
            gradient_predivide_factor=self.gradient_predivide_factor)
        return reduction.reduce(grads, None, context.get().size)

    def _apply_reduced(self, grads, trainable_variables):
        if self._uses_loss_scale():
            compat.loss_scale_apply(self, grads, trainable_variables)
        else:
            self.inner_optimizer.apply(grads, trainable_variables)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        # LossScaleOptimizer's own version would bypass `apply`, hence the allreduce.
        return keras.optimizers.Optimizer.stateless_apply(
            self, optimizer_variables, grads, trainable_variables
        )

    # -- serialization -----------------------------------------------------

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "op": self.op.value,
            "compression": _compression_name(self.compression),
            "backward_passes_per_step": self.backward_passes_per_step,
            "average_aggregated_gradients": self.average_aggregated_gradients,
            "sparse_as_dense": self.sparse_as_dense,
            "gradient_predivide_factor": self.gradient_predivide_factor,
            "loss_scale": self.loss_scale,
            "initial_scale": self.initial_scale,
            "dynamic_growth_steps": self.dynamic_growth_steps,
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
