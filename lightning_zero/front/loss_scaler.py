"""The dynamic loss scale of fp16 training, as a state machine with DeepSpeed's semantics.

fp16 gradients underflow to zero below about 6e-8, so the loss is multiplied by a large scale
before backward and the gradients divided by it before the step. When any gradient overflowed
(inf or nan), the step is skipped and the scale backs off; after ``scale_window`` good steps in a
row it grows again. ``hysteresis`` overflows are tolerated before backing off (each one still skips
its step); with ``consecutive_hysteresis`` the tolerance refills after every good step, otherwise
only when the scale grows. A static scale never changes.

The state is one small fp64 tensor and a step's transition is tensor arithmetic (``advance``), so the
same code runs on the host, from a bool the host read, and on the device, from the device overflow flag.

[Note: skipping on the device]
With ``LossScaleConfig.skip_on_device`` the state lives on the loss's device and ``update`` takes the
all-reduced overflow flag as it is, so a step never waits for the GPU: the fused AdamW step skips on
the same flag, with its step counts on the device (sharding/fused_step.py). What the host learns it
learns ``HOST_LAG`` updates late: each update starts an asynchronous copy of the state into a pinned
buffer and waits for the one started ``HOST_LAG`` updates before, long done by then (so it costs no
stall), which ``host_view`` returns. A fixed lag, not "whatever copy has landed", so that every rank
raises the error (or warns) for an overflow at the minimum scale at the same update: a rank raising
while another goes on into the next step's collectives would hang it. The logged ``loss_scale`` and
``skipped_steps`` come from that view. As under torch's GradScaler, step-wise LR schedulers advance on
skipped steps too (the host does not know which steps were skipped when it steps them).
"""

from __future__ import annotations

import collections
import warnings
from typing import Any

import torch
from torch import Tensor

from lightning_zero.config import LossScaleConfig

SCALE, HYSTERESIS, GOOD_STEPS, SKIPPED_STEPS, STUCK = range(5)  # STUCK: overflows at the minimum scale
HOST_LAG = 2  # updates between the state and the host's view of it, skipping on the device


class LossScaleAtMinimumError(RuntimeError):
    """Gradients overflowed with the loss scale already at its minimum (with ``raise_at_min_scale``)."""


def advance(state: Tensor, overflow: Tensor, config: LossScaleConfig) -> Tensor:
    """The state after one optimizer step; ``overflow`` (0 or 1, on the state's device) says whether it was
    skipped. Branch-free, so a device flag is never read on the host."""
    scale, hysteresis, good, skipped, stuck = state.unbind()
    skipped = skipped + overflow
    if config.static_loss_scale:
        return torch.stack([scale, hysteresis, good, skipped, stuck])
    tolerated = overflow * (hysteresis > 1)  # the step is skipped, the scale holds
    backs_off = overflow - tolerated
    at_minimum = backs_off * (scale <= config.min_loss_scale)  # cannot back off: raise or warn
    stuck = stuck + at_minimum
    hysteresis = hysteresis - tolerated
    scale = torch.where((backs_off - at_minimum) > 0, (scale / config.scale_factor).clamp(config.min_loss_scale), scale)
    good = (good + 1) * (1 - overflow)  # consecutive good steps
    if config.consecutive_hysteresis:
        hysteresis = torch.where(overflow > 0, hysteresis, config.hysteresis)
    grows = (overflow == 0) & (torch.fmod(good, config.scale_window) == 0)
    scale = torch.where(grows, scale * config.scale_factor, scale)
    hysteresis = torch.where(grows, config.hysteresis, hysteresis)
    return torch.stack([scale, hysteresis.to(scale.dtype), good, skipped, stuck])


class DynamicLossScaler:
    """fp16's loss scale as a state machine (see the module's docstring): the scale, the hysteresis left,
    the good steps in a row, the steps skipped and the overflows at the minimum scale, in one fp64 tensor.
    ``config``: its settings; a static scale (``static_loss_scale``) never changes."""

    def __init__(self, config: LossScaleConfig) -> None:
        self.config = config
        start = float(config.static_loss_scale or 2.0**config.initial_scale_power)
        self.state = torch.tensor([start, config.hysteresis, 0, 0, 0], dtype=torch.float64)
        self._stuck_seen = 0  # overflows at the minimum the host has raised or warned about
        self._copies: collections.deque[tuple[Any, Tensor]] = collections.deque()  # (event, host copy) in flight
        self._ring: list[tuple[Any, Tensor]] = []  # HOST_LAG + 1 (event, pinned buffer) the copies cycle through
        self._updates = 0
        self._seen = self.state.clone()  # the host's view of the state (skipping on the device: HOST_LAG late)

    @property
    def dynamic(self) -> bool:
        """Whether the scale changes (no ``static_loss_scale``)."""
        return not self.config.static_loss_scale

    # the exact state, read on the host (a sync when it lives on the device: for checkpoints and tests)
    @property
    def scale(self) -> float:
        """The current scale (read from the state: a sync when it lives on the device)."""
        return float(self.state[SCALE])

    @property
    def hysteresis(self) -> int:
        """The hysteresis left: at 1 the next overflow backs the scale off; above, it is tolerated and takes one off."""
        return int(self.state[HYSTERESIS])

    @property
    def skipped_steps(self) -> int:
        """The optimizer steps skipped for an overflow so far (read from the state)."""
        return int(self.state[SKIPPED_STEPS])

    def scale_tensor(self, device: torch.device | None = None) -> Tensor:
        """The current scale as an fp64 tensor on ``device`` (where the state moves to stay; None: where it is),
        so that 1 / scale rounds to fp32 once, as the host's number does."""
        if device is not None and self.state.device != device:
            self.state = self.state.to(device)
        return self.state[SCALE]

    def update(self, overflow: bool | Tensor) -> None:
        """Advances the state by one optimizer step; ``overflow`` (a bool, or a device flag) says whether it was
        skipped."""
        if torch.is_tensor(overflow):  # a device flag: skipping on the device
            flag = overflow.to(self.state.device, torch.float64).reshape(())
        else:
            flag = torch.tensor(float(overflow), dtype=torch.float64)
        self.state = advance(self.state, flag, self.config)
        if not self.config.skip_on_device:
            self._seen = self.state
        else:
            self._copy_to_host()
        self._check_floor()

    def _copy_to_host(self) -> None:
        """Starts the state's copy into the next pinned buffer; takes the one from HOST_LAG updates ago."""
        on_cuda = self.state.device.type == "cuda"
        if not self._ring:
            buffers = [torch.empty(5, dtype=torch.float64, pin_memory=on_cuda) for _ in range(HOST_LAG + 1)]
            self._ring = [(torch.cuda.Event() if on_cuda else None, buffer) for buffer in buffers]
        # the oldest of the ring: its copy was taken (and cloned) at the last update
        event, buffer = self._ring[self._updates % len(self._ring)]
        self._updates += 1
        buffer.copy_(self.state, non_blocking=on_cuda)
        if event is not None:
            event.record()
        self._copies.append((event, buffer))
        if len(self._copies) > HOST_LAG:
            event, buffer = self._copies.popleft()
            if event is not None:
                event.synchronize()  # recorded HOST_LAG steps ago: done
            self._seen = buffer.clone()

    def host_view(self) -> Tensor:
        """The host's view of the state: the state itself, or HOST_LAG updates late when skipping on the device."""
        return self._seen

    def _check_floor(self) -> None:
        stuck = int(self._seen[STUCK])
        if stuck <= self._stuck_seen:
            return
        self._stuck_seen = stuck
        cfg = self.config
        message = (
            f"the fp16 loss scale is already at its minimum ({cfg.min_loss_scale:g}) and gradients still"
            " overflow: the model's gradients do not fit in fp16. Train with precision='bf16-mixed',"
            " lower the learning rate, or clip gradients."
        )
        if cfg.raise_at_min_scale:
            raise LossScaleAtMinimumError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    def state_dict(self) -> dict[str, Any]:
        """The exact state for a checkpoint: ``scale``, ``hysteresis``, ``good_steps`` and ``skipped_steps``."""
        scale, hysteresis, good, skipped, _ = self.state.tolist()
        return {"scale": scale, "hysteresis": int(hysteresis), "good_steps": int(good), "skipped_steps": int(skipped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Sets the state from ``state`` (``state_dict``'s), on the device the state is on; the host's view is it."""
        values = [
            float(state["scale"]),
            int(state["hysteresis"]),
            int(state["good_steps"]),
            int(state["skipped_steps"]),
        ]
        self.state = torch.tensor([*values, self._stuck_seen], dtype=torch.float64, device=self.state.device)
        self._copies.clear()  # copies of the state before the load: not to be seen after it
        self._seen = self.state.cpu().clone()
