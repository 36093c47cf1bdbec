"""The one typed configuration object of the ZeRO strategies.

A plain dataclass, so it is also an OmegaConf structured config and a jsonargparse-typed argument of
the Lightning CLI. Every field is validated in ``__post_init__``: a bad value fails before any process
is launched, with a message naming the key, the value and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from lightning_zero.config_checks import LOSS_SCALE_ROWS, SUPPORTED_STAGES, ZERO_ROWS, check, validate


@dataclass(frozen=True)
class NvmeSwap:
    """Where and how offloaded optimizer state is swapped to NVMe (see nvme/optimizer_swap.py)."""

    directory: Path
    chunk_numel: int  # elements of state per chunk (each chunk holds a master, exp_avg and exp_avg_sq run)
    buffer_count: int  # chunks in host memory at once (read ahead, stepped, written behind)
    block_size: int  # bytes per I/O request
    queue_depth: int  # requests in flight
    params: bool = False  # stage 3: the trainable units' parameter shards too (nvme/param_swap.py)


@dataclass(frozen=True)
class HostOffload:
    """Where a unit's training state lives when offloaded (see sharding/offload.py)."""

    params: bool = False  # stage 3: the parameter shards live in host memory too
    pin_memory: bool = True
    nvme: NvmeSwap | None = None  # the master and optimizer state in swap files instead of host memory


def stage_of_strategy(name: object) -> int | None:
    """The stage a Trainer strategy name selects: ``zero1`` .. ``zero3``; None for other strategies (``ddp``,
    an instance). A name like ``zero4`` is refused here rather than by Lightning's registry, whose error
    lists every registered strategy but not what was meant."""
    if not isinstance(name, str) or not name.startswith("zero"):
        return None
    stage = name.removeprefix("zero")
    check(
        stage.isdigit() and int(stage) in SUPPORTED_STAGES,
        "trainer.strategy",
        name,
        f"one of {', '.join(f'zero{s}' for s in SUPPORTED_STAGES)} for ZeRO (or a Lightning strategy such as ddp)",
    )
    return int(stage)


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
            "nvme" keeps the master and Adam's moments in swap files under ``nvme_path`` instead, streamed through
            ``nvme_buffer_count`` host buffers at each step (ZeRO-Infinity; see nvme/optimizer_swap.py); the
            reduced gradient partition stays in host memory. Needs AdamW (the host kernel steps it).
        offload_param: stage 3: "cpu" keeps the parameter shards in host memory too, each brought to the
            device for its unit's all-gather (ZeRO-Infinity without NVMe); needs ``offload_optimizer``. "nvme" keeps
            the trainable units' shards in swap files under ``nvme_path``, each read when its unit is gathered and
            written by the step (nvme/param_swap.py; frozen units' stay in host memory); needs it "nvme" too.
        offload_pin_memory: pin the host buffers (CUDA), so copies to and from the device do not block.
        nvme_path: the directory (on an NVMe drive, with O_DIRECT) where each rank makes its swap files; checked
            on every rank at set-up; the files are removed at the end and on errors.
        nvme_buffer_count: chunks of optimizer state in host memory at once (>= 3; DeepSpeed's ``buffer_count``).
        nvme_buffer_numel: elements per chunk: a chunk's buffer is 12 bytes per element (master and both moments).
        aio_block_size: bytes per NVMe read or write request (DeepSpeed's ``aio.block_size``).
        aio_queue_depth: NVMe requests in flight at once (DeepSpeed's ``aio.queue_depth``).
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

    Raises:
        ValueError: a field has a value it does not allow, or one that does not fit with another field (e.g.
            ``secondary_partition`` below stage 3, ``offload_param`` without ``offload_optimizer``, ``nvme``
            without ``nvme_path``); the message names the key (``zero.<field>``), the value and what is allowed.

    Example:
        ```python
        config = ZeroConfig(stage=3, offload_optimizer="cpu")
        trainer = Trainer(strategy=ZeroStrategy(config), precision="bf16-mixed")
        ```
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
    nvme_path: str | None = None
    nvme_buffer_count: int = 4
    nvme_buffer_numel: int = 1 << 23
    aio_block_size: int = 1 << 20
    aio_queue_depth: int = 8
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
        validate(self, "zero", ZERO_ROWS)

    def host_offload(self) -> HostOffload | None:
        """Where units keep their training state: None on the device, else what goes to the host."""
        if self.offload_optimizer == "none":
            return None
        nvme = None
        if self.offload_optimizer == "nvme":
            nvme = NvmeSwap(
                Path(self.nvme_path),
                self.nvme_chunk_numel(),
                self.nvme_buffer_count,
                self.aio_block_size,
                self.aio_queue_depth,
                params=self.offload_param == "nvme",
            )
        params = self.offload_param != "none"  # (on NVMe: read into host memory for their gathers)
        return HostOffload(params=params, pin_memory=self.offload_pin_memory, nvme=nvme)

    def nvme_chunk_numel(self) -> int:
        """``nvme_buffer_numel`` rounded up to 2048 elements, so that a chunk's runs start on 4096-byte boundaries in
        the state's records (fp32) and in a parameter shard's file (16-bit)."""
        return -(-self.nvme_buffer_numel // 2048) * 2048

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

    Raises:
        ValueError: a field has a value it does not allow (the message names the key ``fp16.<field>``), or
            ``min_loss_scale`` is above the starting scale.

    Example:
        ```python
        plugin = ZeroPrecision("16-mixed", loss_scale=LossScaleConfig(initial_scale_power=12))
        ```
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
        validate(self, "fp16", LOSS_SCALE_ROWS)
        start = self.static_loss_scale or 2.0**self.initial_scale_power
        check(
            start >= self.min_loss_scale, "fp16.min_loss_scale", self.min_loss_scale, f"<= the starting scale {start:g}"
        )
