"""The model of a lightning-zero YAML config, built on the meta device for ``lightning-zero estimate``."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from argparse import ArgumentError
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import torch
import yaml
from jsonargparse import ArgumentParser
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import _configure_optimizers
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_zero.config import ZeroConfig, stage_of_strategy
from lightning_zero.models.gpt import GPTConfig
from lightning_zero.planning.activations import LONGEST, ActivationProfile, profile_activations, profiled_rank
from lightning_zero.planning.estimate import ModelShape, shape_of_module
from lightning_zero.sharding.stage3_setup import unit_modules


def read_config(path: str) -> dict:
    """The YAML config at ``path``, checked to be a mapping with a ``model`` section; else a ValueError naming it."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        reason = " ".join(str(error).split())[:200]
        raise ValueError(f"{path}: not a lightning-zero YAML config ({reason})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
        raise ValueError(f"{path}: not a lightning-zero config: no model section (class_path and init_args)")
    return raw


def _build(path: str, sequence_parallel: int = 1) -> tuple[dict, LightningModule]:
    """The config's ``model`` built on the meta device (nothing allocated), its ``configure_model`` run; with a
    ``sequence_parallel`` size, as one rank of such a group (``_one_rank_of``)."""
    raw = read_config(path)
    parser = ArgumentParser(exit_on_error=False)  # a bad model section raises: the caller reports it
    parser.add_subclass_arguments(LightningModule, "model")
    try:
        model_config = parser.parse_object({"model": raw["model"]})
    except ArgumentError as error:
        raise ValueError(f"{path}: model: {' '.join(str(error).split())}") from None
    with torch.device("meta"):
        module = parser.instantiate(model_config).model
        with _one_rank_of(module, sequence_parallel):
            module.configure_model()
    return raw, module


@contextlib.contextmanager
def _one_rank_of(module: LightningModule, size: int) -> Iterator[None]:
    """Inside, ``module`` sees a strategy whose ``sequence_parallel`` is ``profiled_rank(size)`` (what the ZeRO
    strategy gives a model at set-up), for a ``size`` over 1. A GPT's position table is made long enough for any
    sequence the profile tries: without sequence parallelism its length is not checked on fake tensors, so
    activations are counted whatever it is, and with it they are counted alike."""
    if size == 1:
        yield
        return
    if isinstance(getattr(module, "cfg", None), GPTConfig):
        module.cfg = dataclasses.replace(module.cfg, block_size=size * LONGEST)
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(sequence_parallel=profiled_rank(size)))
    try:
        yield
    finally:
        module._trainer = None


def _zero_config(raw: dict) -> ZeroConfig:
    stage = stage_of_strategy((raw.get("trainer") or {}).get("strategy")) or 2
    return ZeroConfig(stage=stage, **(raw.get("zero") or {}))


def shape_of_config(path: str) -> tuple[ModelShape, ZeroConfig]:
    """Builds the config's ``model`` on the meta device, runs its ``configure_model`` and ``configure_optimizers``,
    and reads the ``zero`` options the strategy would use. A file that is not such a config raises ValueError
    (OSError if it cannot be read)."""
    raw, module = _build(path)
    optimizers, _, _ = _configure_optimizers(module.configure_optimizers())
    groups = [g["params"] for opt in optimizers for g in opt.param_groups]
    config = _zero_config(raw)
    return shape_of_module(module, groups, config), config


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """``logger`` says nothing inside (fake tensors log a model's own error before it is raised and reported)."""
    log = logging.getLogger(logger)
    level, log.level = log.level, logging.CRITICAL
    try:
        yield
    finally:
        log.level = level


def activation_profiler(path: str, sequence_parallel: int = 1) -> tuple[Callable[[int], ActivationProfile], int]:
    """For a config whose model is a language model (``forward`` takes token ids ``[batch, seq]``): what one
    micro-batch of the config's ``data.batch_size`` saves at a sequence length (planning/activations.py, on fake CPU
    tensors: nothing allocated, attention as torch runs it there), for the blocks checkpointing would take
    (``checkpointed_blocks``); and that batch size. With a ``sequence_parallel`` size K, what one rank of such a
    group saves, holding a slice of each sample (a length K divides; the model takes ``strategy.sequence_parallel``
    in ``configure_model``, as the GPTModule does). Raises ValueError for a model with no blocks or a forward that
    does not take token ids."""
    raw, module = _build(path, sequence_parallel)
    batch = int(((raw.get("data") or {}).get("init_args") or {}).get("batch_size", 1))
    blocks = unit_modules(module, _zero_config(raw).unit_module_classes)
    if not blocks:
        raise ValueError("the model has no blocks to count activations by (no nn.ModuleList; zero.unit_module_classes)")
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        module.to_empty(device="cpu")
    cache: dict[int, ActivationProfile] = {}

    def profile(seq_len: int) -> ActivationProfile:
        if seq_len not in cache:
            with fake, _quiet("torch._subclasses.fake_tensor"):
                tokens = torch.zeros(batch, seq_len // sequence_parallel, dtype=torch.long)
                try:
                    cache[seq_len] = profile_activations(module, blocks, lambda: module(tokens))
                except Exception as error:  # (any model's own error, reported as the model's)
                    reason = " ".join(str(error).split())[:200]
                    shape = f"[{batch}, {tokens.shape[1]}]"
                    raise ValueError(f"the model's forward on token ids {shape}: {reason}") from None
        return cache[seq_len]

    return profile, batch
