"""The model of a lightning-zero YAML config, built on the meta device for ``lightning-zero estimate``."""

from __future__ import annotations

from argparse import ArgumentError

import torch
import yaml
from jsonargparse import ArgumentParser
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import _configure_optimizers

from lightning_zero.config import ZeroConfig, stage_of_strategy
from lightning_zero.planning.estimate import ModelShape, shape_of_module


def read_config(path: str) -> dict:
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        reason = " ".join(str(error).split())[:200]
        raise ValueError(f"{path}: not a lightning-zero YAML config ({reason})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
        raise ValueError(f"{path}: not a lightning-zero config: no model section (class_path and init_args)")
    return raw


def shape_of_config(path: str) -> tuple[ModelShape, ZeroConfig]:
    """Builds the config's ``model`` on the meta device (nothing allocated), runs its ``configure_model``
    and ``configure_optimizers``, and reads the ``zero`` options the strategy would use. A file that is
    not such a config raises ValueError (OSError if it cannot be read)."""
    raw = read_config(path)
    parser = ArgumentParser(exit_on_error=False)  # a bad model section raises: the caller reports it
    parser.add_subclass_arguments(LightningModule, "model")
    try:
        model_config = parser.parse_object({"model": raw["model"]})
    except ArgumentError as error:
        raise ValueError(f"{path}: model: {' '.join(str(error).split())}") from None
    with torch.device("meta"):
        module = parser.instantiate(model_config).model
        module.configure_model()
    optimizers, _, _ = _configure_optimizers(module.configure_optimizers())
    groups = [g["params"] for opt in optimizers for g in opt.param_groups]
    stage = stage_of_strategy((raw.get("trainer") or {}).get("strategy")) or 2
    config = ZeroConfig(stage=stage, **(raw.get("zero") or {}))
    return shape_of_module(module, groups, config), config
