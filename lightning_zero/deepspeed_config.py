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
OFFLOAD_NVME_KEYS = {  # a section's NVMe settings -> (the ZeroConfig field, how the value is read), or None: no effect
    "nvme_path": ("nvme_path", lambda key, value: value),
    "buffer_count": ("nvme_buffer_count", lambda key, value: _integer(key, value)),
    "buffer_size": None,
    "max_in_cpu": None,
    "pipeline_read": None,
    "pipeline_write": None,
    "pipeline": None,
    "fast_init": None,
}
NVME_NO_EFFECT = (
    "state chunks are always read ahead and written behind, a unit's parameter shard read whole when the schedule"
    " gathers it, and the swap files made whole at set-up"
)
AIO_KEYS = {"block_size": "aio_block_size", "queue_depth": "aio_queue_depth"}  # aio's -> the ZeroConfig field
AIO_NO_EFFECT = {
    "thread_count": "the requests in flight are aio.queue_depth threads' positional reads and writes",
    "single_submit": "requests are submitted as they are cut",
    "overlap_events": "requests always overlap",
    "intra_op_parallelism": "the requests in flight are aio.queue_depth threads' positional reads and writes",
    "use_gds": "GPUDirect Storage is not used: chunks go through host buffers",
}
# activation_checkpointing's keys that change nothing here, and why
ACTIVATION_NO_EFFECT = {
    "partition_activations": "with data parallelism alone no rank holds another's activations: nothing to partition",
    "contiguous_memory_optimization": "offloaded checkpoints always live in one contiguous, reused host buffer",
    "number_checkpoints": "every block is checkpointed",
    "synchronize_checkpoint_boundary": "no device synchronization is needed at a checkpoint's boundary",
    "profile": "Lightning's profilers report",
}
COMMUNICATION_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # -> ZeroConfig.reduce_dtype


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


@dataclass
class _Reading:
    """What the keys read so far say: fields of our configs, and the keys to report."""

    zero: dict[str, Any] = field(default_factory=dict)  # -> ZeroConfig
    loss_scale: dict[str, Any] = field(default_factory=dict)  # -> LossScaleConfig
    settings: dict[str, Any] = field(default_factory=dict)  # -> DeepSpeedSettings' Trainer values
    no_effect: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)  # (one error names them all)


def _number(key: str, value: Any, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or kind is int and value != int(value):
        raise ValueError(
            f"DeepSpeed config: {key} must be {'an integer' if kind is int else 'a number'}, got {value!r}"
        )
    return kind(value)


def _integer(key: str, value: Any) -> int:
    return _number(key, value, int)


def _float(key: str, value: Any) -> float:
    return _number(key, value, float)


def _unchecked(key: str, value: Any) -> Any:
    return value  # (our config checks it, under our name)


def _true_or_false(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"DeepSpeed config: {key} must be true or false, got {value!r}")
    return value


def _stage(key: str, value: Any) -> int:
    stage = _integer(key, value)
    if stage == 0:
        raise ValueError("DeepSpeed config: zero_optimization.stage 0 is plain data parallelism: use strategy='ddp'")
    return stage


def _clip_value(key: str, value: Any) -> float | None:
    return _float(key, value) or None  # 0: no clipping


def _communication_dtype(key: str, value: Any) -> str:
    if value not in COMMUNICATION_DTYPES:
        raise ValueError(f"DeepSpeed config: {key} must be one of {', '.join(COMMUNICATION_DTYPES)}, got {value!r}")
    return COMMUNICATION_DTYPES[value]


# The keys that map one to one: DeepSpeed key -> (the _Reading part it goes to, our field, how its value is read)
MAPPED_KEYS = {
    "zero_optimization.stage": ("zero", "stage", _stage),
    "zero_optimization.reduce_bucket_size": ("zero", "reduce_bucket_size", _integer),
    "zero_optimization.overlap_comm": ("zero", "overlap_comm", _unchecked),
    "zero_optimization.stage3_max_live_parameters": ("zero", "max_live_parameters", _integer),
    "zero_optimization.stage3_prefetch_bucket_size": ("zero", "prefetch_bucket_size", _integer),
    "zero_optimization.stage3_param_persistence_threshold": ("zero", "param_persistence_threshold", _integer),
    # (the weights in fp32 here)
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": ("zero", "save_consolidated", _unchecked),
    "zero_optimization.zero_quantized_weights": ("zero", "quantized_weights", _true_or_false),
    "zero_optimization.zero_quantized_gradients": ("zero", "quantized_gradients", _true_or_false),
    "communication_data_type": ("zero", "reduce_dtype", _communication_dtype),
    "sequence_parallel_size": ("zero", "sequence_parallel_size", _integer),  # (DeepSpeed's Ulysses and ALST)
    "fp16.loss_scale": ("loss_scale", "static_loss_scale", _float),
    "fp16.initial_scale_power": ("loss_scale", "initial_scale_power", _integer),
    "fp16.loss_scale_window": ("loss_scale", "scale_window", _integer),
    "fp16.hysteresis": ("loss_scale", "hysteresis", _integer),
    "fp16.min_loss_scale": ("loss_scale", "min_loss_scale", _float),
    "fp16.consecutive_hysteresis": ("loss_scale", "consecutive_hysteresis", _unchecked),
    "gradient_clipping": ("settings", "gradient_clip_val", _clip_value),
    "gradient_accumulation_steps": ("settings", "accumulate_grad_batches", _integer),
    "train_micro_batch_size_per_gpu": ("settings", "micro_batch_size", _integer),
}


def _offload(key: str, section: Any, reading: _Reading) -> None:
    """``zero_optimization.offload_optimizer`` / ``offload_param``: {device, pin_memory, ratio, NVMe settings}."""
    if not isinstance(section, dict):
        raise ValueError(f'DeepSpeed config: {key} must be an object such as {{"device": "cpu"}}, got {section!r}')
    device = section.get("device", "none")
    if device not in ("none", "cpu", "nvme"):
        reading.unsupported.append(f"{key}.device {device!r} (one of 'none', 'cpu', 'nvme' here)")
        return
    if reading.zero.setdefault(OFFLOAD_SECTIONS[key], device) != device:
        raise ValueError(f"DeepSpeed config: {key} and zero_optimization.cpu_offload disagree")
    for name, value in section.items():
        if name == "pin_memory" and device != "none":
            if not isinstance(value, bool):
                raise ValueError(f"DeepSpeed config: {key}.pin_memory must be true or false, got {value!r}")
            if reading.zero.setdefault("offload_pin_memory", value) != value:
                raise ValueError("DeepSpeed config: offload_optimizer.pin_memory and offload_param.pin_memory differ")
        elif name == "ratio" and value != 1 and device != "none":
            reading.unsupported.append(f"{key}.ratio {value!r} (partial offload; remove it to offload all of it)")
        elif name in OFFLOAD_NVME_KEYS and device == "nvme" and OFFLOAD_NVME_KEYS[name] is not None:
            field, read_value = OFFLOAD_NVME_KEYS[name]
            if reading.zero.setdefault(field, read_value(f"{key}.{name}", value)) != value:
                raise ValueError(f"DeepSpeed config: the offload sections' {name} differ")
        elif name in OFFLOAD_NVME_KEYS or (name in ("pin_memory", "ratio") and device == "none"):
            note = f"{key}.{name} ({NVME_NO_EFFECT if device == 'nvme' else 'not offloaded to NVMe'})"
            reading.no_effect.append(note if name in OFFLOAD_NVME_KEYS else f"{key}.{name}")
        elif name not in ("device", "pin_memory", "ratio"):
            reading.unsupported.append(f"{key}.{name}")
    if device == "none":
        reading.no_effect.append(f"{key} (device 'none': nothing is offloaded)")


def _aio(key: str, section: Any, reading: _Reading) -> None:
    """DeepSpeed's ``aio`` section: the swap files' request size and queue depth (nvme/swap_file.py)."""
    if not isinstance(section, dict):
        raise ValueError(f'DeepSpeed config: {key} must be an object such as {{"queue_depth": 8}}, got {section!r}')
    for name, value in section.items():
        if name in AIO_KEYS:
            reading.zero[AIO_KEYS[name]] = _integer(f"{key}.{name}", value)
        elif name in AIO_NO_EFFECT:
            reading.no_effect.append(f"{key}.{name} ({AIO_NO_EFFECT[name]})")
        else:
            reading.unsupported.append(f"{key}.{name}")


def _mics_shard_size(key: str, value: Any, reading: _Reading) -> None:
    """MiCS: shard within groups, replicate across them."""
    size = _integer(key, value)
    if size != -1:  # -1: off (DeepSpeed's default)
        reading.zero["shard_group_size"] = size


def _hpz_partition_size(key: str, value: Any, reading: _Reading) -> None:
    size = _integer(key, value)
    if size > 1:
        reading.zero.update(secondary_partition=True, node_size=size)
    else:
        reading.no_effect.append(f"{key} (1: no secondary partition)")


def _cpu_offload(key: str, value: Any, reading: _Reading) -> None:
    """DeepSpeed's older spelling of offload_optimizer: cpu."""
    device = "cpu" if _true_or_false(key, value) else "none"
    if reading.zero.setdefault("offload_optimizer", device) != device:
        raise ValueError(f"DeepSpeed config: {key} and zero_optimization.offload_optimizer disagree")


def _activation_checkpointing(key: str, section: Any, reading: _Reading) -> None:
    """The section (Lightning's DeepSpeedStrategy writes it, all false by default, from its ``partition_activations``,
    ``cpu_checkpointing``, ``contiguous_memory_optimization`` and ``synchronize_checkpoint_boundary`` arguments)
    configures the checkpoint function a DeepSpeed model's code calls; it turns nothing on by itself. Here the
    engine checkpoints the blocks when ``zero.activation_checkpointing`` says so, and ``cpu_checkpointing: true``,
    the one setting with an effect, asks for that with the checkpoints offloaded ("units" unless set otherwise)."""
    if not isinstance(section, dict):
        example = '{"cpu_checkpointing": true}'
        raise ValueError(f"DeepSpeed config: {key} must be an object such as {example}, got {section!r}")
    for name, value in section.items():
        if name == "cpu_checkpointing" and value != "auto":
            if _true_or_false(f"{key}.{name}", value):
                reading.zero.update(activation_checkpointing="units", offload_activations="cpu")
            else:
                reading.no_effect.append(f"{key}.{name} (false: nothing is offloaded)")
        elif name in ACTIVATION_NO_EFFECT:
            reading.no_effect.append(f"{key}.{name} ({ACTIVATION_NO_EFFECT[name]})")
        elif name != "cpu_checkpointing":
            reading.unsupported.append(f"{key}.{name}")


# The keys read by a function of their own: DeepSpeed key -> (key, value, the _Reading to add to)
HANDLED_KEYS = {
    "zero_optimization.offload_optimizer": _offload,
    "zero_optimization.offload_param": _offload,
    "zero_optimization.mics_shard_size": _mics_shard_size,
    "zero_optimization.zero_hpz_partition_size": _hpz_partition_size,
    "zero_optimization.cpu_offload": _cpu_offload,
    "aio": _aio,
    "activation_checkpointing": _activation_checkpointing,
}


def _read_keys(flat: dict[str, Any]) -> _Reading:
    """Every key of the flattened config, mapped, noted as changing nothing, or listed as unsupported."""
    reading = _Reading()
    # DeepSpeed reads nothing else of a section that says "enabled": false, and shipped configs often keep
    # their loss-scale settings there: inert, so accepted without a word (or a check).
    disabled = {section for section in ("fp16", "bf16") if flat.get(f"{section}.enabled") is False}
    for key, value in flat.items():
        if value == "auto" or key in ("fp16.enabled", "bf16.enabled") or key.rpartition(".")[0] in disabled:
            continue
        if key in MAPPED_KEYS:
            part, name, read_value = MAPPED_KEYS[key]
            getattr(reading, part)[name] = read_value(key, value)
        elif key in NO_EFFECT:
            reading.no_effect.append(f"{key} ({NO_EFFECT[key]})")
        elif key in HANDLED_KEYS:
            HANDLED_KEYS[key](key, value, reading)
        else:
            reading.unsupported.append(key)
    return reading


def _precision(fp16: Any, bf16_enabled: bool) -> str | None:
    """The Trainer's precision the fp16 and bf16 sections select (None: the Trainer's own)."""
    if fp16 is True and bf16_enabled:
        raise ValueError("DeepSpeed config: fp16.enabled and bf16.enabled are both true; choose one")
    precision = {True: "16-mixed", False: None if bf16_enabled else "32-true"}.get(fp16)
    return "bf16-mixed" if bf16_enabled else precision


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
    fp16 = flat.get("fp16.enabled")  # True, False, "auto" (the Trainer decides) or None (absent)
    reading = _read_keys(flat)
    if reading.unsupported:
        raise ValueError(
            f"DeepSpeed config: these keys are not supported: {', '.join(sorted(reading.unsupported))}. Remove them,"
            " or for whole sections handled elsewhere (optimizer, scheduler: configure_optimizers) pass ignore=(...)"
        )
    precision = _precision(fp16, flat.get("bf16.enabled") is True)
    if reading.loss_scale and fp16 not in (True, "auto"):
        raise ValueError(f"DeepSpeed config: fp16 loss-scale keys {sorted(reading.loss_scale)} need fp16.enabled: true")
    if reading.no_effect:
        warnings.warn("DeepSpeed config keys accepted with no effect: " + "; ".join(reading.no_effect), stacklevel=2)
    return DeepSpeedSettings(
        zero=dataclasses.replace(ZeroConfig(), **reading.zero),
        precision=precision,
        loss_scale=LossScaleConfig(**reading.loss_scale) if fp16 in (True, "auto") else None,
        no_effect=reading.no_effect,
        **reading.settings,
    )
