"""ZeroPrecision: the precision plugin of the ZeRO strategies; it owns backward, clipping and the step.

``32-true``: fp32 compute. ``bf16-mixed``: bf16 autocast for compute, fp32 parameters, gradients and
master partitions; bf16 has fp32's exponent range, so gradients do not underflow and no loss scaling
is needed. ``16-mixed`` (fp16 with dynamic loss scaling) is not implemented yet and is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision

from lightning_zero.sharding.zero_optimizer import ZeroOptimizer

SUPPORTED_PRECISION = ("32-true", "bf16-mixed")


def validate_precision(precision: str) -> None:
    if precision == "16-mixed":
        raise ValueError(
            "precision '16-mixed' (fp16 with dynamic loss scaling) is not supported by the ZeRO strategies yet;"
            f" use one of {', '.join(SUPPORTED_PRECISION)}"
        )
    if precision not in SUPPORTED_PRECISION:
        raise ValueError(f"the ZeRO strategies support precision {', '.join(SUPPORTED_PRECISION)}; got {precision!r}")


def unwrap_optimizer(optimizer: Any) -> Any:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class ZeroPrecision(Precision):
    def __init__(self, precision: str = "32-true", device: str | None = None) -> None:
        validate_precision(str(precision))
        self.precision = str(precision)
        self.device = device  # autocast device type; the strategy fills it in at setup when None

    def forward_context(self) -> contextlib.AbstractContextManager:
        if self.precision == "bf16-mixed":
            return torch.autocast(self.device or "cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def optimizer_step(
        self,
        optimizer: Any,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        zero = unwrap_optimizer(optimizer)
        if not isinstance(zero, ZeroOptimizer):
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        closure_result = closure()  # forward and backward; the strategy reduces gradients after backward
        zero.prepare_grads()
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, then clipping
        zero.step(**kwargs)
        return closure_result

    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        zero = unwrap_optimizer(optimizer)
        if isinstance(zero, ZeroOptimizer):
            zero.clip_grad_norm_(float(clip_val))
        else:
            super().clip_grad_by_norm(optimizer, clip_val)
