"""The model of a lightning-zero YAML config, built on the meta device for ``lightning-zero estimate``."""

from __future__ import annotations

import torch
import yaml
from jsonargparse import ArgumentParser
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import _configure_optimizers

from lightning_zero.config import ZeroConfig
from lightning_zero.estimate import ModelShape, shape_of_module


def shape_of_config(path: str) -> tuple[ModelShape, ZeroConfig]:
    """Builds the config's ``model`` on the meta device (nothing allocated), runs its ``configure_model``
    and ``configure_optimizers``, and reads the ``zero`` options the strategy would use."""
    with open(path) as f:
        raw = yaml.safe_load(f)
    if "model" not in raw:
        raise ValueError(f"{path}: no model section (class_path and init_args of a LightningModule)")
    parser = ArgumentParser()
    parser.add_subclass_arguments(LightningModule, "model")
    with torch.device("meta"):
        module = parser.instantiate(parser.parse_object({"model": raw["model"]})).model
        module.configure_model()
    optimizers, _, _ = _configure_optimizers(module.configure_optimizers())
    groups = [g["params"] for opt in optimizers for g in opt.param_groups]
    strategy = (raw.get("trainer") or {}).get("strategy")
    stage = int(strategy[-1]) if isinstance(strategy, str) and strategy.startswith("zero") else 2
    config = ZeroConfig(stage=stage, **(raw.get("zero") or {}))
    return shape_of_module(module, groups, config), config
