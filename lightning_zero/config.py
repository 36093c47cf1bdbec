"""The one typed configuration object of the ZeRO strategies.

A plain dataclass, so it is also an OmegaConf structured config and a jsonargparse-typed argument of
the Lightning CLI. Every field is validated in ``__post_init__``: a bad value fails before any process
is launched, with a message naming the key, the value and what is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_STAGES = (1, 2, 3)
REDUCE_DTYPES = ("float32", "bfloat16", "float16")
OFFLOAD_ALLOWED = "none or cpu (nvme offload is not supported)"
ACTIVATION_CHECKPOINTING = ("none", "units", "selective")


@dataclass(frozen=True)
class HostOffload:
    """Where a unit's training state lives when offloaded (see sharding/offload.py)."""

    params: bool = False  # stage 3: the parameter shards live in host memory too
    pin_memory: bool = True


def stage_of_strategy(name: object) -> int | None:
    """The stage a Trainer strategy name selects: ``zero1`` .. ``zero3``; None for other strategies (``ddp``,
    an instance). A name like ``zero4`` is refused here rather than by Lightning's registry, whose error
    lists every registered strategy but not what was meant."""
    if not isinstance(name, str) or not name.startswith("zero"):
        return None
    stage = name.removeprefix("zero")
    _check(
        stage.isdigit() and int(stage) in SUPPORTED_STAGES,
        "trainer.strategy",
        name,
        f"one of {', '.join(f'zero{s}' for s in SUPPORTED_STAGES)} for ZeRO (or a Lightning strategy such as ddp)",
    )
    return int(stage)


def _check(ok: bool, key: str, value: object, allowed: str) -> None:
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


def _validate(config: object, section: str, rows: tuple[Row, ...]) -> None:
    for key, ok, allowed in rows:
        value = getattr(config, key)
        _check(ok(value, config), f"{section}.{key}", value, allowed)


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
    return offload_param == "none" or (config.stage == 3 and config.offload_optimizer == "cpu")


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
    ("offload_optimizer", _one_of("none", "cpu"), OFFLOAD_ALLOWED),
    ("offload_param", _one_of("none", "cpu"), OFFLOAD_ALLOWED),
    ("offload_param", _offloaded_with_optimizer, "none unless zero.stage is 3 and zero.offload_optimizer is cpu"),
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


@dataclass(kw_only=True)
class ZeroConfig:
    """How the ZeRO strategy shards and communicates.

    The fields are flat, so that each keeps one name in YAML, on the CLI, in Hydra and in the DeepSpeed
    mapping; they are listed (and declared) by concern: what is sharded (``stage``); communication
    (``reduce_bucket_size`` .. ``timeout``); stage 3 and ZeRO++ (``unit_module_classes`` .. ``node_size``); offload
    and the step (``offload_optimizer`` .. ``fused_step``); activations; checkpoints, buffers and debugging.

    Attributes:
        stage: 1 shards the optimizer state (and fp32 master weights); 2 also shards gradients; 3 also
            shards the parameters, gathering each unit only around its use.
        reduce_bucket_size: stages 1 and 2: elements per gradient bucket. Each bucket is one
            reduce-scatter and one all-gather per step. Stage 3: units released for reduction one after
            another are reduce-scattered together until they hold this many elements (a larger unit is
            reduced on its own); smaller values start reductions earlier in backward, larger ones issue
            fewer collectives.
        overlap_comm: reduce-scatter a bucket asynchronously as soon as its gradients are complete,
            while backward continues (stage 1: in the backward of the step's last micro-batch). When off,
            each bucket is reduced synchronously.
        max_inflight_bytes: gradient bytes of launched reduce-scatters kept in flight at once before
            the oldest is waited on (at least one is always allowed); with the buckets still filling,
            this bounds the transient gradient memory (stages 2 and 3; stage 1 reduces out of its
            persistent full gradient, so nothing is gained by waiting early).
        overlap_param_gather: stages 1 and 2: start the all-gathers of the updated parameters right after
            the optimizer step and wait for each bucket just before the first torch op that reads one of
            its parameters, so the gathers overlap the next forward (see sharding/param_gather.py).
        reduce_dtype: the dtype gradients are accumulated and reduce-scattered in: "float32",
            "bfloat16" or "float16"; None (default) keeps the parameters' dtype, except bf16 parameters
            (stage 3 with bf16 gathers), whose gradients are reduced in fp32 for exactness. "bfloat16"
            halves the bytes sent (DeepSpeed's ``communication_data_type``).
        shard_group_size: hybrid sharding (sharding/topology.py): states are sharded inside groups of this
            many consecutive ranks and replicated across groups, whose partitions are all-reduced once per
            step; "node" = the ranks of one node; null (default) = the whole world. Must divide the
            world size.
        timeout: seconds a collective may wait for the other ranks before the run fails with an error.
        unit_module_classes: stage 3: class names of the modules that become units (gathered and freed
            as a whole). Empty: every child of an ``nn.ModuleList`` (transformer blocks), then, outside
            those, the smallest modules holding at least ``unit_min_params`` parameters.
        unit_min_params: stage 3, with no ``unit_module_classes``: the size from which a module outside every
            ModuleList becomes a unit of its own (an ``nn.Sequential`` of large layers, a large embedding); 0: off.
        max_live_parameters: stage 3: prefetching never holds more than this many elements of gathered
            units at once (the unit about to run is gathered regardless).
        prefetch_bucket_size: stage 3: prefetching gathers units ahead of the one running until they hold this many
            elements (the last may cross it; DeepSpeed's ``stage3_prefetch_bucket_size``); 0 turns prefetch off.
        param_persistence_threshold: stage 3: units of at most this many elements stay gathered.
        gather_dtype: stage 3 with ``bf16-mixed``: "compute" (default) keeps parameter shards in bf16 and
            gathers units in bf16 from the fp32 master (half the bytes, and autocast keeps no second
            copy of each weight for backward); "float32" gathers fp32 weights that autocast casts.
        quantized_weights: stage 3: the step's parameter all-gathers (forward and backward) send int8 values
            with one fp32 scale per block (ZeRO++'s qwZ; DeepSpeed's ``zero_quantized_weights``): about a quarter
            of fp32's bytes, half of bf16's. The master weights, the optimizer, state dicts, checkpoints and
            ``gathered_parameters`` stay exact (see sharding/quantize.py).
        quantization_block_size: elements per quantization block (one scale each); smaller blocks bound the
            error tighter (half a step of the block's largest magnitude / 127) and send more scales.
        secondary_partition: stage 3: after a unit's forward gather each rank keeps its 1/K of the unit (K: the
            ranks of its node, ``node_size``), so the unit's backward gather stays inside the node (ZeRO++'s hpZ;
            DeepSpeed's ``zero_hpz_partition_size``). Costs up to Psi/K elements per rank between a forward and
            its backward (``memory_bytes()["secondary_partition"]``); exact.
        quantized_gradients: stages 2 and 3: gradients are reduce-scattered in two levels, at full precision
            inside each node, then as block-wise int8 between nodes (ZeRO++'s qgZ; DeepSpeed's
            ``zero_quantized_gradients``); see sharding/quantize.py.
        quantized_gradient_bits: 8 (default) or 4: the bits of each gradient value crossing nodes with
            ``quantized_gradients`` (4: half the bytes, 16x the rounding step: see the README for when it holds).
        node_size: ranks per node for ZeRO++'s two levels (null: the launcher's ranks per node); divides the world.
        offload_optimizer: "cpu" keeps each rank's fp32 master partition, optimizer state and reduced
            gradient partition in host memory and runs the optimizer step there (ZeRO-Offload; see
            sharding/offload.py); "none" (default) keeps them on the device. Stages 1, 2 and 3.
        offload_param: stage 3: "cpu" keeps the parameter shards in host memory too, each brought to the
            device for its unit's all-gather (ZeRO-Infinity without NVMe); needs ``offload_optimizer="cpu"``.
        offload_pin_memory: pin the host buffers (CUDA), so copies to and from the device do not block.
        fused_step: AdamW steps each unit's partition with one fused kernel pass per bucket (unscale, clip,
            update, and the 16-bit parameter copy; see sharding/fused_step.py): "auto" (default) where the
            CUDA kernels run and, for offloaded units, the host AdamW kernel (kernels/host.py); "always"
            also for every CPU master (the host kernel, or the CUDA kernels' pure-torch reference without
            a C compiler); "never".
        activation_checkpointing: the model's blocks (the children of its ``nn.ModuleList``s, or the classes
            ``unit_module_classes`` names) keep only their inputs for backward and recompute the rest there
            (torch's non-reentrant checkpoint; see activations/checkpointing.py): "units" recomputes all of each
            block, "selective" keeps matmul and attention outputs and recomputes the pointwise ops; "none" (default).
        offload_activations: "cpu" copies what checkpointed blocks keep (their inputs) to one reused host buffer
            during the forward, and back one block ahead of backward (ZeRO-R's Pa+cpu, DeepSpeed's
            ``cpu_checkpointing``; activations/host_offload.py); needs ``activation_checkpointing``. "none" (default).
        sequence_parallel_size: groups of this many consecutive ranks hold slices of the same samples along their
            sequence, attention across them (Ulysses: the model takes ``strategy.sequence_parallel``); 1: off.
        broadcast_buffers: as ddp's default: every buffer (BatchNorm's running statistics) is broadcast from
            rank 0 before a step's first training forward and before validation during ``fit``, so every rank
            validates with the same statistics (sharding/buffer_sync.py). False: each rank keeps its own
            (after the start), as ddp with ``broadcast_buffers=False``.
        save_consolidated: every checkpoint also holds ``consolidated.ckpt``, the whole model's weights in
            fp32 with the hyper-parameters, which ``MyModule.load_from_checkpoint`` opens in a plain process;
            rank 0 streams it from the shard files (about one parameter in memory), at every save. The
            ``lightning-zero consolidate`` command writes the same from any checkpoint afterwards.
        async_save: a checkpoint save copies this rank's state to host memory and returns; a writer thread
            writes, hashes, agrees and publishes it while training goes on (checkpoint/background.py). At most
            one save is in flight (the next save and the end of the run wait for it); a failed one raises on
            every rank at the next training step; saves on a preemption signal complete before the exit.
        checkpoint_on_signal: on SIGTERM or SIGUSR1 (SLURM's requeue signal) every rank finishes its
            optimizer step, writes a checkpoint and exits with 128 + the signal's number (see
            resilience/preemption.py: ``PreemptionCheckpoint`` sets where; under SLURM with auto-requeue the job is
            requeued); false: the ranks stop at the same step boundary without writing.
        check_collectives: debug mode: record every collective the strategy issues and, before each
            step, compare the ranks' sequences since the last step (one all-gather of a digest, and of
            the sequences when they differ): a rank that would issue a different collective fails with
            an error naming the first difference instead of hanging later.
    """

    # what is sharded
    stage: int = 2
    # communication
    reduce_bucket_size: int = 25_000_000
    overlap_comm: bool = True
    max_inflight_bytes: int = 200_000_000
    overlap_param_gather: bool = True
    reduce_dtype: str | None = None
    shard_group_size: int | str | None = None
    timeout: float = 1800.0
    # stage 3
    unit_module_classes: list[str] = field(default_factory=list)
    unit_min_params: int = 1_000_000
    max_live_parameters: int = 1_000_000_000
    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    gather_dtype: str = "compute"
    quantized_weights: bool = False
    quantization_block_size: int = 256
    secondary_partition: bool = False
    quantized_gradients: bool = False
    quantized_gradient_bits: int = 8
    node_size: int | None = None
    # offload and the step
    offload_optimizer: str = "none"
    offload_param: str = "none"
    offload_pin_memory: bool = True
    fused_step: str = "auto"
    # activations
    activation_checkpointing: str = "none"
    offload_activations: str = "none"
    sequence_parallel_size: int = 1
    # checkpoints, buffers and debugging
    broadcast_buffers: bool = True
    save_consolidated: bool = False
    async_save: bool = False
    checkpoint_on_signal: bool = True
    check_collectives: bool = False

    def __post_init__(self) -> None:
        _validate(self, "zero", ZERO_ROWS)

    def host_offload(self) -> HostOffload | None:
        """Where units keep their training state: None on the device, else what goes to the host."""
        if self.offload_optimizer == "none":
            return None
        return HostOffload(params=self.offload_param == "cpu", pin_memory=self.offload_pin_memory)

    def unit_options(self, param_dtype: torch.dtype) -> dict:
        """The keyword arguments a trainable unit of ``param_dtype`` parameters is built with."""
        return {"grad_dtype": self.grad_dtype(param_dtype), "offload": self.host_offload()}

    def grad_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """The dtype gradients of ``param_dtype`` parameters are reduced and accumulated in."""
        if self.reduce_dtype is not None:
            return getattr(torch, self.reduce_dtype)
        return torch.float32 if param_dtype == torch.bfloat16 else param_dtype


@dataclass(kw_only=True)
class LossScaleConfig:
    """fp16 loss scaling (``ZeroPrecision("16-mixed")``), with DeepSpeed's defaults and meaning.

    Attributes:
        static_loss_scale: a fixed scale; 0 (default) means dynamic scaling.
        initial_scale_power: dynamic scaling starts at 2**initial_scale_power.
        scale_window: consecutive good steps before the scale grows by ``scale_factor``.
        scale_factor: how much the scale grows or shrinks at a time.
        hysteresis: overflows tolerated (their steps still skipped) before the scale backs off.
        consecutive_hysteresis: refill the tolerance after every good step, not only when the scale grows.
        min_loss_scale: the scale never goes below this.
        raise_at_min_scale: an overflow at the minimum scale raises (default) or only warns.
        skip_on_device: decide a step's skip on the device, without a host sync (see front/loss_scaler.py's
            [Note: skipping on the device]); needs the fused AdamW step. Off (default): the host reads the
            overflow flag once a step, as DeepSpeed does.
    """

    static_loss_scale: float = 0.0
    initial_scale_power: int = 16
    scale_window: int = 1000
    scale_factor: float = 2.0
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    raise_at_min_scale: bool = True
    skip_on_device: bool = False

    def __post_init__(self) -> None:
        _validate(self, "fp16", LOSS_SCALE_ROWS)
        start = self.static_loss_scale or 2.0**self.initial_scale_power
        _check(
            start >= self.min_loss_scale, "fp16.min_loss_scale", self.min_loss_scale, f"<= the starting scale {start:g}"
        )
