"""ZeroPrecision: the precision plugin of the ZeRO strategies; it owns backward, clipping and the step.

- ``32-true``: fp32 everywhere.
- ``bf16-mixed``: bf16 autocast for compute; fp32 parameters, gradients and master partitions. bf16
  has fp32's exponent range, so gradients do not underflow and no loss scaling is needed.
- ``16-mixed``: DeepSpeed's fp16 mode. Parameters and gradients are fp16 (views into fp16 flat
  buffers), master partitions and optimizer state fp32; compute runs under fp16 autocast (so
  layer norms, softmax and the loss run in fp32). The loss is multiplied by a dynamic loss scale
  before backward; a step whose gradients overflowed on any rank is skipped on every rank, and
  the scale backs off (``loss_scaler.py``).

[Note: the fp16 step]
closure (forward, scaled backward, reduce-scatter) -> ``prepare_grads``: one MAX all-reduce of the
used-flags and the overflow flag, read on the host once -> on overflow: skip (parameters, optimizer
state and, through the strategy, step-wise LR schedulers stay as they were), update the scale ->
otherwise: ``on_before_optimizer_step`` hooks and clipping (the norm is taken on the scaled fp32
gradients and divided by the scale), one multiply by clip_coef / scale, the optimizer step, the
all-gather, update the scale. ``on_before_optimizer_step`` therefore sees gradients still scaled by
``loss_scale`` in fp16, as in DeepSpeed. With ``LossScaleConfig.skip_on_device`` nothing is read: the hooks,
clipping and the fused step run on every step, the step skipping on the device overflow flag, and the
scale's state machine runs on the device (loss_scaler.py's [Note: skipping on the device]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.nn import Module

from lightning_zero.config import LossScaleConfig
from lightning_zero.front.grad_norms import sharded_grads
from lightning_zero.front.loss_scaler import HOST_LAG, SCALE, SKIPPED_STEPS, DynamicLossScaler
from lightning_zero.sharding.zero_optimizer import ZeroOptimizer

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "16-mixed")
GRAD_NORM_KEY = "zero/grad_norm"  # the global gradient norm, logged in steps that clip by norm


def validate_precision(precision: str) -> None:
    """Raises a ValueError naming the supported precisions unless ``precision`` is one of them."""
    if precision not in SUPPORTED_PRECISION:
        raise ValueError(f"the ZeRO strategies support precision {', '.join(SUPPORTED_PRECISION)}; got {precision!r}")


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer inside Lightning's ``LightningOptimizer`` wrapper; any other object as it is."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class ZeroPrecision(Precision):
    """The precision plugin of the ZeRO strategies (Trainer and Fabric): it owns backward's loss scaling, gradient
    clipping and the optimizer step.

    ``Trainer(precision="bf16-mixed")`` (or ``Fabric(precision=...)``) under a ZeRO strategy becomes one of these;
    make one yourself for fp16's loss scaling: ``Trainer(strategy="zero2", plugins=[ZeroPrecision("16-mixed",
    loss_scale=LossScaleConfig(...))])``. "32-true" is fp32 everywhere; "bf16-mixed" computes under bf16 autocast
    with fp32 gradients and masters (and fp32 parameters, but stage 3's bf16 shards with ``gather_dtype="compute"``);
    "16-mixed" is DeepSpeed's fp16 mode: fp16 parameters and gradients, fp32 masters and optimizer state, a dynamic
    loss scale, and a step whose gradients overflowed on any rank skipped on every rank. Under the Trainer it logs
    ``loss_scale`` and ``skipped_steps`` (fp16) at every step, and ``zero/grad_norm`` at each step that clips by norm.

    Args:
        precision: "32-true", "bf16-mixed" or "16-mixed".
        device: the autocast device type ("cuda", "cpu"); None: the strategy fills in its device's.
        loss_scale: fp16 loss scaling; only for "16-mixed" (``LossScaleConfig()`` by default).

    Raises:
        ValueError: ``precision`` is none of the three, or ``loss_scale`` is given with another precision; at
            set-up, ``LossScaleConfig(skip_on_device=True)`` without the fused AdamW step (an optimizer it does
            not step, such as AdamW with ``amsgrad``, or ``ZeroConfig(fused_step="never")``).
        LossScaleAtMinimumError: (a RuntimeError, from lightning_zero/front/loss_scaler.py) under "16-mixed", when
            gradients still overflow at ``min_loss_scale`` and ``raise_at_min_scale`` is set (else a warning).
    """

    def __init__(
        self, precision: str = "32-true", device: str | None = None, loss_scale: LossScaleConfig | None = None
    ) -> None:
        precision = str(precision)
        validate_precision(precision)
        if loss_scale is not None and precision != "16-mixed":
            raise ValueError(f"loss_scale only applies to precision '16-mixed', got precision {precision!r}")
        self.precision = precision
        self.device = device
        self.scaler = DynamicLossScaler(loss_scale or LossScaleConfig()) if precision == "16-mixed" else None
        self.last_grad_norm: Tensor | None = None
        self._skips_reported = 0  # skip_on_device: skipped steps already printed

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The dtype parameters are converted to (None: kept as they are)."""
        return torch.float16 if self.precision == "16-mixed" else None

    def convert_module(self, module: Module) -> Module:
        return module.to(self.param_dtype) if self.param_dtype is not None else module

    def convert_buffers(self, module: Module) -> None:
        """What ``convert_module`` does to buffers, for a module whose parameters are converted elsewhere."""
        for submodule in module.modules():
            for name, buffer in submodule._buffers.items():
                if self.param_dtype is not None and buffer is not None and buffer.is_floating_point():
                    submodule._buffers[name] = buffer.to(self.param_dtype)

    def forward_context(self) -> contextlib.AbstractContextManager:
        if self.precision == "32-true":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16
        return torch.autocast(self.device or "cpu", dtype=dtype)

    @property
    def skip_on_device(self) -> bool:
        """Whether fp16 steps are skipped on the device (loss_scaler.py's [Note: skipping on the device])."""
        return self.scaler is not None and self.scaler.config.skip_on_device

    def _loss_scale(self, device: torch.device | None = None) -> float | Tensor:
        """The scale the loss is multiplied by: 1 without fp16, a number, or when skipping on the device the fp64
        device scalar (on ``device``, or where it is), whose fp32 rounding is the number's."""
        if self.scaler is None:
            return 1.0
        return self.scaler.scale_tensor(device) if self.skip_on_device else self.scaler.scale

    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:
        """The Trainer's backward: its strategy's ZeroOptimizers learn the loss scale (see ``scale_loss``)."""
        return self.scale_loss(super().pre_backward(tensor, module), module.trainer.strategy.optimizers)

    def scale_loss(self, tensor: Tensor, optimizers: list) -> Tensor:
        """The loss to run backward on: multiplied by the fp16 loss scale (which ``optimizers`` learn, so that
        ``grad_norm()`` can unscale gradients anywhere in the step)."""
        if self.scaler is None:
            return tensor
        scale = self._loss_scale(tensor.device)
        for optimizer in optimizers:
            if isinstance(optimizer, ZeroOptimizer):
                optimizer.scaled_by(scale)
        return tensor * (scale.to(tensor.dtype) if torch.is_tensor(scale) else scale)

    def optimizer_step(self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any):
        zero = unwrap_optimizer(optimizer)
        if not isinstance(zero, ZeroOptimizer):
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        closure_result = closure()  # forward and backward; the strategy reduces gradients after backward

        def hooks() -> None:
            with sharded_grads(model, [zero]):
                self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, then clipping

        self.zero_step(zero, before_step=hooks, step_number=model.trainer.global_step, **kwargs)
        self._log(model)
        return closure_result

    def zero_step(
        self, zero: ZeroOptimizer, *, before_step: Callable[[], None] = lambda: None, step_number: int, **kwargs: Any
    ) -> bool:
        """The step after backward (see [Note: the fp16 step]): the gradients reduced, then the step skipped
        on an fp16 overflow, or ``before_step()`` and the step; the loss scale updated. Whether it stepped."""
        scale = self._loss_scale()
        found_inf = self._prepare(zero)
        if found_inf is True:
            zero.skip_step()
            self.scaler.update(overflow=True)
            if self.scaler.scale != scale:
                rank_zero_info(
                    f"fp16 gradients overflowed at step {step_number}: step skipped, loss scale"
                    f" {scale:g} -> {self.scaler.scale:g} ({self.scaler.skipped_steps} skipped so far)"
                )
            return False
        before_step()
        zero.step(**kwargs)
        if self.scaler is not None:
            self.scaler.update(found_inf)
        return True

    def _log(self, model: pl.LightningModule) -> None:
        if self.scaler is not None:
            # host tensors: Lightning keeps them on the host (a number would become a device tensor: a sync)
            seen = self.scaler.host_view()  # the state itself, or its copy from HOST_LAG steps ago
            model.log("loss_scale", seen[SCALE].float(), prog_bar=True)
            model.log("skipped_steps", seen[SKIPPED_STEPS].float(), prog_bar=True)
            skipped = int(seen[SKIPPED_STEPS]) if self.skip_on_device else 0  # (the host copy: no sync)
            if skipped > self._skips_reported:  # learnt late: no step number
                self._skips_reported = skipped
                rank_zero_info(
                    f"fp16 gradients overflowed: {skipped} steps skipped so far, loss scale {float(seen[SCALE]):g}"
                    f" as of step {model.trainer.global_step - HOST_LAG}"
                )
        if self.last_grad_norm is not None:  # (clipped in this step: by the closure, or by hand before it)
            model.log(GRAD_NORM_KEY, self.last_grad_norm)  # (a key of ours: never over a metric the user logs)
            self.last_grad_norm = None

    def _prepare(self, zero: ZeroOptimizer) -> bool | Tensor:
        """Reduces the step's gradients (once per step: idempotent). Returns the fp16 overflow flag: False,
        True (skip), or when skipping on the device the flag itself, unread (the fused step skips on it)."""
        fp16 = dict(check_finite=self.scaler is not None, on_device=self.skip_on_device)
        return zero.prepare_grads(loss_scale=self._loss_scale(), **fp16)

    # Clipping reduces the gradients first: under manual optimization ``self.clip_gradients(opt, ...)`` comes
    # before ``opt.step()``, which would otherwise reduce them after (and undo a clip factor kept pending).

    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        zero = unwrap_optimizer(optimizer)
        if isinstance(zero, ZeroOptimizer):
            self._prepare(zero)
            self.last_grad_norm = zero.clip_grad_norm_(float(clip_val))
        else:
            super().clip_grad_by_norm(optimizer, clip_val)

    def clip_grad_by_value(self, optimizer: Any, clip_val: int | float) -> None:
        zero = unwrap_optimizer(optimizer)
        if isinstance(zero, ZeroOptimizer):
            self._prepare(zero)
            zero.unscale_()  # elementwise clipping needs the true values; sharding does not change it
            for grad in [u.training.step_grad for u in zero.units if u.training.step_grad is not None]:
                grad.clamp_(
                    -clip_val, clip_val
                )  # (the pieces' gradients are views of these; NVMe units have no pieces)
        else:
            super().clip_grad_by_value(optimizer, clip_val)

    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "loss_scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scaler"])
            self._skips_reported = self.scaler.skipped_steps


def as_zero_precision(plugin: Any) -> ZeroPrecision | None:
    """The plugin Lightning (or Fabric) builds from ``precision=...``, as ours: None and ZeroPrecision as they
    are, 32-true and the mixed precisions converted, anything else refused with what is supported."""
    if plugin is None or isinstance(plugin, ZeroPrecision):
        return plugin
    if type(plugin) in (Precision, FabricPrecision):
        return ZeroPrecision("32-true")
    if isinstance(plugin, (MixedPrecision, FabricMixedPrecision)):
        return ZeroPrecision(plugin.precision, device=plugin.device)
    validate_precision(str(getattr(plugin, "precision", None)))
    raise ValueError(f"the ZeRO strategies need ZeroPrecision, got {type(plugin).__name__}")


def stage3_param_dtype(precision: ZeroPrecision, gather_dtype: str) -> torch.dtype | None:
    """Stage 3 keeps shards (and gathers units) in the compute dtype under bf16-mixed, and in fp16 under
    16-mixed; None keeps what the model has (``convert_module`` handled the whole-model cases)."""
    if precision.precision == "bf16-mixed" and gather_dtype == "compute":
        return torch.bfloat16
    return precision.param_dtype


def check_skip_on_device(optimizers: list, fused_step: str) -> None:
    """Skipping fp16 steps on the device needs the fused AdamW step (which skips on the device flag); a unit on a
    GPU that the CUDA kernels will not step (they did not load) reads the flag after all: said once."""
    for zero in optimizers:
        if not isinstance(zero, ZeroOptimizer):
            continue
        if zero.fused is None:
            raise ValueError(
                "fp16.skip_on_device needs the fused AdamW step: torch.optim.AdamW (no amsgrad, maximize,"
                " capturable, differentiable, fused or tensor lr) or FusedAdamW, with zero.fused_step 'auto' or"
                f" 'always'; got {type(zero.optimizer).__name__} with fused_step {fused_step!r}"
            )
        on_gpu = [u for u in zero.units if u.training.master is not None and u.training.master.is_cuda]
        reading = [u for u in on_gpu if zero.fused.backend(u) != "cuda"]
        if reading:
            rank_zero_warn(
                f"fp16.skip_on_device: {len(reading)} units on the GPU will not take the CUDA kernels (are CuPy and"
                " the kernels loading?): their steps read the overflow flag on the host, a sync a step"
            )


def hold_schedulers_on_skipped_steps(lr_scheduler_configs: list, optimizers: list) -> None:
    """[Note: skipped steps] An fp16 step skipped for overflow did not happen, so step-wise LR schedulers
    must not advance either (Lightning steps them after every optimizer step)."""
    owner = {id(z.optimizer): z for z in optimizers if isinstance(z, ZeroOptimizer)}
    for config in lr_scheduler_configs:
        zero = owner.get(id(config.scheduler.optimizer))
        if config.interval == "step" and zero is not None:
            config.scheduler = SkipAwareScheduler(config.scheduler, zero)


class SkipAwareScheduler:
    """Forwards everything to an LR scheduler, except ``step`` after a skipped optimizer step."""

    def __init__(self, scheduler: Any, optimizer: ZeroOptimizer) -> None:
        self.scheduler = scheduler
        self.zero_optimizer = optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Steps the scheduler, unless the optimizer's last step was skipped for an fp16 overflow."""
        if not self.zero_optimizer.last_step_skipped:
            self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)
