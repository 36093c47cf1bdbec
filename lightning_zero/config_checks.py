"""The validation of the configuration objects (config.py): predicates and, per config, the table of rows they are
checked against."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_zero.config import ZeroConfig

SUPPORTED_STAGES = (1, 2, 3)
REDUCE_DTYPES = ("float32", "bfloat16", "float16")
OFFLOAD_CHOICES = ("none", "cpu", "nvme")
ACTIVATION_CHECKPOINTING = ("none", "units", "selective")


def check(ok: bool, key: str, value: object, allowed: str) -> None:
    """Raises ValueError ``<key> must be <allowed>, got <value>`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{key} must be {allowed}, got {value!r}")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# [Note: validation tables]
# A config is validated by walking a table of rows (field, predicate, what is allowed): the first row whose
# predicate fails raises, naming the field, its value and the allowed text, so a table's order is the order
# in which errors are reported. A predicate gets the field's value and the whole config: most read only the
# value; the cross-field ones (named below) read other fields, and sit after the rows that check those.
Predicate = Callable[[Any, Any], bool]
Row = tuple[str, Predicate, str]


def validate(config: object, section: str, rows: tuple[Row, ...]) -> None:
    """Checks ``config`` against ``rows`` in order (see [Note: validation tables]); the first failing row raises a
    ValueError naming the field as ``<section>.<field>``."""
    for key, ok, allowed in rows:
        value = getattr(config, key)
        check(ok(value, config), f"{section}.{key}", value, allowed)


def _is_bool(value: object, _config: object) -> bool:
    return isinstance(value, bool)


def _one_of(*choices: object) -> Predicate:
    return lambda value, _config: value in choices


def _integer_in(low: int, high: float = math.inf) -> Predicate:
    return lambda value, _config: _integer(value) and low <= value <= high


def _number_above(low: float) -> Predicate:
    return lambda value, _config: _number(value) and value > low


def _number_at_least(low: float) -> Predicate:
    return lambda value, _config: _number(value) and value >= low


def _either(*predicates: Predicate) -> Predicate:
    return lambda value, config: any(ok(value, config) for ok in predicates)


def _class_names(value: object, _config: object) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(name, str) for name in value)


def _only_at_stage_3(enabled: object, config: ZeroConfig) -> bool:
    return not enabled or config.stage == 3


def _not_at_stage_1(enabled: object, config: ZeroConfig) -> bool:
    return not enabled or config.stage > 1


def _world_with_zero_plus_plus(shard_group_size: object, config: ZeroConfig) -> bool:
    """ZeRO++'s secondary partition and two-level gradient reduction shard over the whole world."""
    return shard_group_size is None or not (config.secondary_partition or config.quantized_gradients)


def _offloaded_with_optimizer(offload_param: object, config: ZeroConfig) -> bool:
    return offload_param == "none" or (config.stage == 3 and config.offload_optimizer != "none")


def _nvme_with_optimizer(offload_param: object, config: ZeroConfig) -> bool:
    return offload_param != "nvme" or config.offload_optimizer == "nvme"


def _path_for_nvme(nvme_path: object, config: ZeroConfig) -> bool:
    if config.offload_optimizer == "nvme" or config.offload_param == "nvme":
        return isinstance(nvme_path, str) and nvme_path != ""
    return nvme_path is None or isinstance(nvme_path, str)


def _aligned_bytes(value: object, _config: object) -> bool:
    return _integer(value) and value > 0 and value % 4096 == 0


def _with_checkpointing(offload_activations: object, config: ZeroConfig) -> bool:
    return offload_activations == "none" or config.activation_checkpointing != "none"


def _supported_stage(stage: object, _config: object) -> bool:
    return _integer(stage) and stage in SUPPORTED_STAGES


# ZeroConfig's rows (see [Note: validation tables]), by concern as its fields are declared
ZERO_ROWS: tuple[Row, ...] = (
    ("stage", _supported_stage, f"one of {', '.join(map(str, SUPPORTED_STAGES))}"),
    # communication
    ("reduce_bucket_size", _integer_in(1), "an integer > 0 (elements)"),
    ("overlap_comm", _is_bool, "true or false"),
    ("max_inflight_bytes", _integer_in(1), "an integer > 0 (bytes)"),
    ("overlap_param_gather", _is_bool, "true or false"),
    ("reduce_dtype", _one_of(None, *REDUCE_DTYPES), f"null or one of {', '.join(REDUCE_DTYPES)}"),
    ("timeout", _number_above(0), "a number of seconds > 0"),
    (
        "shard_group_size",
        _either(_one_of(None, "node"), _integer_in(1)),
        'null (the whole world), "node" or an integer >= 1 that divides the world size',
    ),
    # stage 3
    ("unit_module_classes", _class_names, "a list of module class names"),
    ("unit_min_params", _integer_in(0), "an integer >= 0 (parameters)"),
    ("max_live_parameters", _integer_in(1), "an integer > 0 (elements)"),
    ("prefetch_bucket_size", _integer_in(0), "an integer >= 0 (elements)"),
    ("param_persistence_threshold", _integer_in(0), "an integer >= 0 (elements)"),
    ("gather_dtype", _one_of("compute", "float32"), "compute or float32"),
    ("quantized_weights", _is_bool, "true or false"),
    ("quantized_weights", _only_at_stage_3, "false unless zero.stage is 3"),
    ("quantization_block_size", _integer_in(1), "an integer >= 1 (elements per int8 block with one scale)"),
    ("secondary_partition", _is_bool, "true or false"),
    ("secondary_partition", _only_at_stage_3, "false unless zero.stage is 3"),
    ("quantized_gradients", _is_bool, "true or false"),
    ("quantized_gradients", _not_at_stage_1, "false at zero.stage 1"),
    ("quantized_gradient_bits", _one_of(8, 4), "8 or 4"),
    (
        "node_size",
        _either(_one_of(None), _integer_in(1)),
        "null (the launcher's ranks per node) or an integer >= 1 that divides the world size",
    ),
    (
        "shard_group_size",
        _world_with_zero_plus_plus,
        "null with zero.secondary_partition or zero.quantized_gradients (ZeRO++ shards over the world)",
    ),
    # offload and the step
    ("offload_optimizer", _one_of(*OFFLOAD_CHOICES), "none, cpu or nvme"),
    ("offload_param", _one_of(*OFFLOAD_CHOICES), "none, cpu or nvme"),
    (
        "offload_param",
        _offloaded_with_optimizer,
        "none unless zero.stage is 3 and zero.offload_optimizer is cpu or nvme",
    ),
    ("offload_param", _nvme_with_optimizer, "cpu or none unless zero.offload_optimizer is nvme"),
    ("nvme_path", _path_for_nvme, "a directory on an NVMe drive (a non-empty string) when an offload is nvme"),
    ("nvme_buffer_count", _integer_in(3), "an integer >= 3 (a chunk read ahead, one stepped, one written behind)"),
    ("nvme_buffer_numel", _integer_in(1024), "an integer >= 1024 (elements of state per chunk)"),
    ("aio_block_size", _aligned_bytes, "a positive multiple of 4096 (bytes per request)"),
    ("aio_queue_depth", _integer_in(1), "an integer >= 1 (requests in flight)"),
    ("offload_pin_memory", _is_bool, "true or false"),
    ("fused_step", _one_of("auto", "always", "never"), "auto, always or never"),
    # activations
    ("activation_checkpointing", _one_of(*ACTIVATION_CHECKPOINTING), "none, units or selective"),
    ("offload_activations", _one_of("none", "cpu"), "none or cpu"),
    ("offload_activations", _with_checkpointing, "none unless zero.activation_checkpointing is units or selective"),
    ("sequence_parallel_size", _integer_in(1), "an integer >= 1 that divides the world size"),
    # checkpoints, buffers and debugging
    ("broadcast_buffers", _is_bool, "true or false"),
    ("save_consolidated", _is_bool, "true or false"),
    ("async_save", _is_bool, "true or false"),
    ("checkpoint_on_signal", _is_bool, "true or false"),
    ("check_collectives", _is_bool, "true or false"),
)

# LossScaleConfig's rows, checked before the starting scale against the minimum
LOSS_SCALE_ROWS: tuple[Row, ...] = (
    ("static_loss_scale", _number_at_least(0), "a number >= 0 (0 = dynamic)"),
    ("initial_scale_power", _integer_in(0, 64), "an integer in [0, 64]"),
    ("scale_window", _integer_in(1), "an integer >= 1"),
    ("scale_factor", _number_above(1), "a number > 1"),
    ("hysteresis", _integer_in(1), "an integer >= 1"),
    ("consecutive_hysteresis", _is_bool, "true or false"),
    ("min_loss_scale", _number_above(0), "a number > 0"),
    ("raise_at_min_scale", _is_bool, "true or false"),
    ("skip_on_device", _is_bool, "true or false"),
)
