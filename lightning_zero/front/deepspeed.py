"""A DeepSpeed JSON config (deepspeed_config.py reads it) as the Trainer's strategy and arguments."""

from __future__ import annotations

from typing import Any

from lightning_zero.deepspeed_config import read_deepspeed_config
from lightning_zero.front.precision import ZeroPrecision


def strategy(cls: type, source: Any, *, ignore: tuple[str, ...] = ()) -> Any:
    """``cls`` (ZeroStrategy) as the config describes it, its fp16 loss scaling included."""
    settings = read_deepspeed_config(source, ignore=ignore)
    made = cls(settings.zero)
    if settings.precision is not None:
        made.precision_plugin = ZeroPrecision(settings.precision, loss_scale=settings.loss_scale)
    return made


def trainer_kwargs(cls: type, source: Any, *, ignore: tuple[str, ...] = ()) -> dict[str, Any]:
    """Keyword arguments for ``Trainer``: the strategy (a ``cls``), the fp16 plugin or precision, clipping and
    accumulation."""
    settings = read_deepspeed_config(source, ignore=ignore)
    kwargs: dict[str, Any] = {"strategy": cls(settings.zero)}
    if settings.precision == "16-mixed":
        kwargs["plugins"] = [ZeroPrecision("16-mixed", loss_scale=settings.loss_scale)]
    elif settings.precision is not None:
        kwargs["precision"] = settings.precision
    for key in ("gradient_clip_val", "accumulate_grad_batches"):
        if getattr(settings, key) is not None:
            kwargs[key] = getattr(settings, key)
    return kwargs
