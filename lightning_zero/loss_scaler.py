"""The dynamic loss scale of fp16 training, as a state machine with DeepSpeed's semantics.

fp16 gradients underflow to zero below about 6e-8, so the loss is multiplied by a large scale
before backward and the gradients divided by it before the step. When any gradient overflowed
(inf or nan), the step is skipped and the scale backs off; after ``scale_window`` good steps in a
row it grows again. ``hysteresis`` overflows are tolerated before backing off (each one still skips
its step); with ``consecutive_hysteresis`` the tolerance refills after every good step, otherwise
only when the scale grows. A static scale never changes.
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning_zero.config import LossScaleConfig


class LossScaleAtMinimumError(RuntimeError):
    pass


class DynamicLossScaler:
    def __init__(self, config: LossScaleConfig) -> None:
        self.config = config
        self.scale = float(config.static_loss_scale or 2.0**config.initial_scale_power)
        self.hysteresis = config.hysteresis  # overflows still tolerated before backing off
        self.good_steps = 0  # consecutive steps without overflow
        self.skipped_steps = 0

    @property
    def dynamic(self) -> bool:
        return not self.config.static_loss_scale

    def update(self, overflow: bool) -> None:
        """Advances the state by one optimizer step; ``overflow`` says whether it was skipped."""
        if overflow:
            self.skipped_steps += 1
        if not self.dynamic:
            return
        cfg = self.config
        if overflow:
            self.good_steps = 0
            if self.hysteresis > 1:
                self.hysteresis -= 1
                return
            if self.scale <= cfg.min_loss_scale:
                message = (
                    f"the fp16 loss scale is already at its minimum ({cfg.min_loss_scale:g}) and gradients still"
                    " overflow: the model's gradients do not fit in fp16. Train with precision='bf16-mixed',"
                    " lower the learning rate, or clip gradients."
                )
                if cfg.raise_at_min_scale:
                    raise LossScaleAtMinimumError(message)
                warnings.warn(message, RuntimeWarning, stacklevel=2)
                return
            self.scale = max(self.scale / cfg.scale_factor, cfg.min_loss_scale)
            return
        self.good_steps += 1
        if cfg.consecutive_hysteresis:
            self.hysteresis = cfg.hysteresis
        if self.good_steps % cfg.scale_window == 0:
            self.scale *= cfg.scale_factor
            self.hysteresis = cfg.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "hysteresis": self.hysteresis,
            "good_steps": self.good_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.hysteresis = int(state["hysteresis"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
