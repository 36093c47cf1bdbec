"""Comparing runs: the whole model's state as a run gives it, and how far two results are apart.

The equivalence tests train one model two ways (ZeRO against ddp or one process, resumed against
uninterrupted, another world size) and compare what ``full_state`` (or a copy of it: ``whole_state``,
``final_state``) returns, tensors or lists of losses, through ``relative_error`` or ``assert_close``.
Light on purpose (torch only): the rank processes and the launched scripts import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import lightning.pytorch as pl


# --- the states compared -------------------------------------------------------------------------
def full_state(strategy) -> dict[str, torch.Tensor]:
    """The whole model's state dict as a user asks each strategy for it: the ZeRO strategies'
    ``full_state_dict()`` (collective), ddp's and one device's ``lightning_module_state_dict()``."""
    read = getattr(strategy, "full_state_dict", None) or strategy.lightning_module_state_dict
    return read()


def whole_state(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """``full_state`` of the trainer's strategy as detached float32 copies, kept unchanged by later steps."""
    return {k: v.detach().float().clone() for k, v in full_state(trainer.strategy).items()}


def final_state(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """The whole model after fit through the ZeRO strategy's ``gather_module`` (stage 3 gathers it;
    collective), on the CPU: detached copies in the model's own dtypes."""
    return {k: v.detach().clone() for k, v in trainer.strategy.gather_module().state_dict().items()}


# --- how far apart ------------------------------------------------------------------------------
def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| (Frobenius norms, in float64; ``b`` = 0 counts as 1e-30)."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def assert_close(a, b, what: str, tol: float = 1e-5) -> None:
    """``a`` (tensor, number or list) within ``tol`` of ``b``, relative: same shape, not empty; each failure
    names ``what`` and the difference."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, f"{what}: shapes {tuple(a.shape)} and {tuple(b.shape)}"
    assert a.numel() > 0, f"{what}: nothing to compare"
    err = relative_error(a, b)
    assert err <= tol, f"{what}: differs by {err:.2e} (relative)"
