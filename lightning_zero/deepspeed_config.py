"""A DeepSpeed JSON config, read into our typed configs and the Trainer's arguments.

Every key is either mapped, accepted because it changes nothing here (listed in a warning with the
reason), or refused: all refused keys are named in one error, so nothing is silently ignored (except
the rest of an ``fp16`` or ``bf16`` section whose ``"enabled"`` is false, which DeepSpeed ignores too).
``"auto"`` (Hugging Face's convention: "take it from the trainer") leaves our default, or the
Trainer's own value, in place. DeepSpeed-side optimizers and schedulers are refused unless the
caller lists them in ``ignore``: with Lightning they come from ``configure_optimizers``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_zero.config import LossScaleConfig, ZeroConfig

# zero_optimization keys we map: DeepSpeed name -> ZeroConfig field
ZERO_KEYS = {
    "stage": "stage",
    "reduce_bucket_size": "reduce_bucket_size",
    "overlap_comm": "overlap_comm",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_gather_16bit_weights_on_model_save": "save_consolidated",  # (the weights in fp32 here)
}
ZERO_BOOL_KEYS = ("overlap_comm", "stage3_gather_16bit_weights_on_model_save")
# keys that change nothing here, and why
NO_EFFECT = {
    "zero_optimization.allgather_bucket_size": "parameters are all-gathered in the reduce buckets",
    "zero_optimization.allgather_partitions": "partitions are always all-gathered",
    "zero_optimization.reduce_scatter": "gradients are always reduce-scattered",
    "zero_optimization.contiguous_gradients": "gradient storage is always contiguous",
    "zero_optimization.round_robin_gradients": "buckets are reduced in one fixed order",
    "zero_optimization.stage3_max_reuse_distance": "units are freed after use and gathered again when needed",
    "zero_optimization.sub_group_size": "the optimizer steps this rank's pieces directly",
    "zero_optimization.memory_efficient_linear": "no linear layers are patched",
    "fp16.auto_cast": "16-mixed always runs the forward under fp16 autocast",
    "bf16.immediate_grad_update": "bf16-mixed keeps fp32 gradients",
    "train_batch_size": "follows from the micro batch, the accumulation and the world size",
    "steps_per_print": "Lightning's logger and progress bar report",
    "wall_clock_breakdown": "Lightning's profilers report",
    "zero_allow_untested_optimizer": "any elementwise torch optimizer is supported",
    "prescale_gradients": "gradients are always divided by the world size before the reduction",
    "zero_optimization.mics_hierarchical_params_gather": "parameters are gathered inside the shard group only",
}
OFFLOAD_SECTIONS = {  # -> the ZeroConfig field
    "zero_optimization.offload_optimizer": "offload_optimizer",
    "zero_optimization.offload_param": "offload_param",
}
OFFLOAD_NVME_KEYS = (
    "nvme_path",
    "buffer_count",
    "buffer_size",
    "max_in_cpu",
    "pipeline_read",
    "pipeline_write",
    "fast_init",
    "pipeline",
)
COMMUNICATION_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # -> ZeroConfig.reduce_dtype
LOSS_SCALE_KEYS = {
    "initial_scale_power": "initial_scale_power",
    "loss_scale_window": "scale_window",
    "hysteresis": "hysteresis",
    "min_loss_scale": "min_loss_scale",
    "consecutive_hysteresis": "consecutive_hysteresis",
}


@dataclass
class DeepSpeedSettings:
    """What a DeepSpeed config says, in our terms. None means: keep the Trainer's (or data's) own value."""

    zero: ZeroConfig
    precision: str | None = None  # "16-mixed", "bf16-mixed" or "32-true"
    loss_scale: LossScaleConfig | None = None  # with fp16 enabled, or "auto" (for when the Trainer picks 16-mixed)
    gradient_clip_val: float | None = None
    accumulate_grad_batches: int | None = None
    micro_batch_size: int | None = None
    no_effect: list[str] = field(default_factory=list)  # keys accepted that change nothing


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and key in ("zero_optimization", "fp16", "bf16"):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _offload(key: str, section: Any, zero: dict[str, Any], no_effect: list[str], unsupported: list[str]) -> None:
    """``zero_optimization.offload_optimizer`` / ``offload_param``: {device, pin_memory, ratio, NVMe settings}.
    What is not supported goes to ``unsupported`` (one error names them all)."""
    if not isinstance(section, dict):
        raise ValueError(f'DeepSpeed config: {key} must be an object such as {{"device": "cpu"}}, got {section!r}')
    device = section.get("device", "none")
    if device not in ("none", "cpu"):
        unsupported.append(f"{key}.device {device!r} (NVMe offload is not implemented; use 'cpu' or 'none')")
        return
    if zero.setdefault(OFFLOAD_SECTIONS[key], device) != device:
        raise ValueError(f"DeepSpeed config: {key} and zero_optimization.cpu_offload disagree")
    for name, value in section.items():
        if name == "pin_memory" and device == "cpu":
            if not isinstance(value, bool):
                raise ValueError(f"DeepSpeed config: {key}.pin_memory must be true or false, got {value!r}")
            if zero.setdefault("offload_pin_memory", value) != value:
                raise ValueError("DeepSpeed config: offload_optimizer.pin_memory and offload_param.pin_memory differ")
        elif name == "ratio" and value != 1 and device == "cpu":
            unsupported.append(f"{key}.ratio {value!r} (partial offload; remove it to offload all of it)")
        elif name in OFFLOAD_NVME_KEYS or (name in ("pin_memory", "ratio") and device == "none"):
            no_effect.append(f"{key}.{name} (no NVMe offload here)" if name in OFFLOAD_NVME_KEYS else f"{key}.{name}")
        elif name not in ("device", "pin_memory", "ratio"):
            unsupported.append(f"{key}.{name}")
    if device == "none":
        no_effect.append(f"{key} (device 'none': nothing is offloaded)")


def _number(key: str, value: Any, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or kind is int and value != int(value):
        raise ValueError(
            f"DeepSpeed config: {key} must be {'an integer' if kind is int else 'a number'}, got {value!r}"
        )
    return kind(value)


def _load(source: str | os.PathLike | dict[str, Any]) -> dict[str, Any]:
    if isinstance(source, dict):
        return source
    try:
        config = json.loads(Path(source).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"DeepSpeed config {source}: no such file") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"DeepSpeed config {source}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"DeepSpeed config {source}: must be a JSON object of settings, got a {type(config).__name__}")
    return config


def read_deepspeed_config(
    source: str | os.PathLike | dict[str, Any], *, ignore: tuple[str, ...] = ()
) -> DeepSpeedSettings:
    """Reads a DeepSpeed config (a JSON file or its dict). ``ignore`` names top-level keys to drop on purpose."""
    flat = {k: v for k, v in _flatten(_load(source)).items() if k.split(".")[0] not in ignore}
    zero: dict[str, Any] = {}
    loss_scale: dict[str, Any] = {}
    settings: dict[str, Any] = {}
    unsupported, no_effect = [], []
    fp16 = flat.get("fp16.enabled")  # True, False, "auto" (the Trainer decides) or None (absent)
    bf16_enabled = flat.get("bf16.enabled") is True
    # DeepSpeed reads nothing else of a section that says "enabled": false, and shipped configs often keep
    # their loss-scale settings there: inert, so accepted without a word (or a check).
    disabled = {section for section in ("fp16", "bf16") if flat.get(f"{section}.enabled") is False}
    for key, value in flat.items():
        section, _, name = key.rpartition(".")
        if value == "auto" or key in ("fp16.enabled", "bf16.enabled") or section in disabled:
            continue
        if section == "zero_optimization" and name in ZERO_KEYS:
            kind = bool if name in ZERO_BOOL_KEYS else int
            zero[ZERO_KEYS[name]] = value if kind is bool else _number(key, value, int)
            if name == "stage" and value == 0:
                raise ValueError(
                    "DeepSpeed config: zero_optimization.stage 0 is plain data parallelism: use strategy='ddp'"
                )
        elif key == "fp16.loss_scale":
            loss_scale["static_loss_scale"] = _number(key, value, float)
        elif section == "fp16" and name in LOSS_SCALE_KEYS:
            kind = bool if name == "consecutive_hysteresis" else (float if name == "min_loss_scale" else int)
            loss_scale[LOSS_SCALE_KEYS[name]] = value if kind is bool else _number(key, value, kind)
        elif key == "gradient_clipping":
            settings["gradient_clip_val"] = _number(key, value, float) or None
        elif key == "gradient_accumulation_steps":
            settings["accumulate_grad_batches"] = _number(key, value, int)
        elif key == "train_micro_batch_size_per_gpu":
            settings["micro_batch_size"] = _number(key, value, int)
        elif key == "communication_data_type":
            if value not in COMMUNICATION_DTYPES:
                raise ValueError(
                    f"DeepSpeed config: {key} must be one of {', '.join(COMMUNICATION_DTYPES)}, got {value!r}"
                )
            zero["reduce_dtype"] = COMMUNICATION_DTYPES[value]
        elif key in NO_EFFECT:
            no_effect.append(f"{key} ({NO_EFFECT[key]})")
        elif key in OFFLOAD_SECTIONS:
            _offload(key, value, zero, no_effect, unsupported)
        elif key == "zero_optimization.mics_shard_size":  # MiCS: shard within groups, replicate across
            size = _number(key, value, int)
            if size != -1:  # -1: off (DeepSpeed's default)
                zero["shard_group_size"] = size
        elif key == "zero_optimization.zero_quantized_weights":
            if not isinstance(value, bool):
                raise ValueError(f"DeepSpeed config: {key} must be true or false, got {value!r}")
            zero["quantized_weights"] = value
        elif key == "zero_optimization.zero_hpz_partition_size":
            size = _number(key, value, int)
            if size > 1:
                zero.update(secondary_partition=True, node_size=size)
            else:
                no_effect.append(f"{key} (1: no secondary partition)")
        elif key == "zero_optimization.zero_quantized_gradients":
            if not isinstance(value, bool):
                raise ValueError(f"DeepSpeed config: {key} must be true or false, got {value!r}")
            zero["quantized_gradients"] = value
        elif key == "zero_optimization.cpu_offload":  # DeepSpeed's older spelling of offload_optimizer: cpu
            if not isinstance(value, bool):
                raise ValueError(f"DeepSpeed config: {key} must be true or false, got {value!r}")
            if zero.setdefault("offload_optimizer", "cpu" if value else "none") != ("cpu" if value else "none"):
                raise ValueError(f"DeepSpeed config: {key} and zero_optimization.offload_optimizer disagree")
        else:
            unsupported.append(key)
    if unsupported:
        raise ValueError(
            f"DeepSpeed config: these keys are not supported: {', '.join(sorted(unsupported))}. Remove them, or for"
            " whole sections handled elsewhere (optimizer, scheduler: configure_optimizers) pass ignore=(...)"
        )
    if fp16 is True and bf16_enabled:
        raise ValueError("DeepSpeed config: fp16.enabled and bf16.enabled are both true; choose one")
    precision = {True: "16-mixed", False: None if bf16_enabled else "32-true"}.get(fp16)
    precision = "bf16-mixed" if bf16_enabled else precision
    if loss_scale and fp16 not in (True, "auto"):
        raise ValueError(f"DeepSpeed config: fp16 loss-scale keys {sorted(loss_scale)} need fp16.enabled: true")
    if no_effect:
        warnings.warn("DeepSpeed config keys accepted with no effect: " + "; ".join(no_effect), stacklevel=2)
    return DeepSpeedSettings(
        zero=dataclasses.replace(ZeroConfig(), **zero),
        precision=precision,
        loss_scale=LossScaleConfig(**loss_scale) if fp16 in (True, "auto") else None,
        no_effect=no_effect,
        **settings,
    )
