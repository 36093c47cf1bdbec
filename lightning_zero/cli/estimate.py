"""``lightning-zero estimate``: per-rank memory, communication per link and (with hardware figures) the
step time of every strategy, and the largest model each fits (estimate.py, comm_model.py, time_model.py)."""

from __future__ import annotations

import argparse
import dataclasses
import math

from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_zero.cli.args import InputError, Parser
from lightning_zero.config import ZeroConfig
from lightning_zero.planning.activations import MODES, longest_fitting, mode_name
from lightning_zero.planning.comm_model import Ulysses, format_traffic
from lightning_zero.planning.estimate import estimate, format_table, parse_bytes, shape_of_count, smallest_fitting
from lightning_zero.planning.time_model import CLUSTERS, Hardware, flops_per_token, format_step_times, measure_here
from lightning_zero.sequence.ulysses import check_heads
from lightning_zero.sharding.topology import resolve_shard_size

MAX_ESTIMATE_RANKS = 1 << 17  # about 5 s of estimate


def _parameter_count(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"must be a number of parameters >= 1, e.g. 1.3e9, got {text!r}")
    return int(value)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def estimate_main(args: list[str]) -> None:
    """``lightning-zero estimate``: parses ``args`` (the arguments after the command's name) and prints the
    tables; bad arguments raise an InputError, reported by ``main`` as one line."""
    parsed = _parser().parse_args(args)
    world, shard, capacity = _sizes(parsed)
    if parsed.params is not None:
        shape, config = shape_of_count(parsed.params), ZeroConfig()
    else:
        shape, config = _shape_of_model(parsed.model)
    sequence = _sequence_parallel(parsed, config)  # (bad input: before output)
    activations = _activation_profile(parsed) if parsed.seq_len is not None else None
    table = estimate(shape, shard, parsed.precision, config, offload=parsed.offload)
    _print_memory(parsed, shape.psi, table, world, shard, capacity)
    if parsed.offload == "nvme":
        _print_nvme_io(parsed, table)
    traffic = {"world": world, "per_node": parsed.devices, "shard_size": shard, "micro_batches": parsed.micro_batches}
    print(format_traffic(shape.psi, parsed.precision, **traffic, sequence=sequence))
    if sequence is not None:
        _print_exchanges(sequence)
    if capacity is not None:
        _print_fit(parsed.device_memory, table, capacity, parsed.devices, activations is not None)
    if activations is not None:
        _print_activations(parsed, *activations, table, capacity)
    hardware = _hardware(parsed)
    if hardware is not None:
        _print_step_times(parsed, shape.psi, hardware, world, shard, capacity, sequence)


def _parser() -> Parser:
    """The subcommand's flags: the model, the world, precision and memory, and what the step time needs."""
    parser = Parser(
        prog="lightning-zero estimate",
        description="Per-rank bytes of parameters, gradients and optimizer state (Adam) under ddp, zero1, zero2"
        " and zero3, as the strategies allocate them (padding included; activations with --model and --seq-len).",
    )
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", type=_parameter_count, help="the number of trainable parameters, e.g. 1.3e9")
    model.add_argument("--model", help="a lightning-zero YAML config: its model is built on the meta device")
    parser.add_argument("--devices", type=_positive_int, default=1, help="devices (processes) per node")
    parser.add_argument("--nodes", type=_positive_int, default=1)
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "16-mixed"])
    parser.add_argument(
        "--device-memory", help="memory per device, e.g. 80GB or 80GiB: names the smallest stage that fits"
    )
    parser.add_argument(
        "--offload",
        default="none",
        choices=["none", "cpu", "nvme"],
        help="cpu: also the ZeRO-Offload configurations (master weights and optimizer state in host memory,"
        " zero3 with parameters there too), with their host bytes per rank; nvme: also those with the master and"
        " optimizer state on NVMe (zero.offload_optimizer nvme), with the swap files' bytes and the I/O per step",
    )
    parser.add_argument(
        "--nvme-bw",
        type=_positive_float,
        help="with --offload nvme: GB/s a node's NVMe drives read (and write) at, shared by its ranks: the least time"
        " a step's optimizer I/O takes",
    )
    parser.add_argument(
        "--micro-batches", type=_positive_int, default=1, help="micro-batches per optimizer step (accumulation)"
    )
    parser.add_argument(
        "--shard-group-size",
        type=_shard_group_size,
        help='hybrid sharding: shard inside groups of this many ranks ("node": one node), replicate across',
    )
    parser.add_argument(
        "--seq-len",
        type=_positive_int,
        help="tokens per sample: with --model (a language model), each activation checkpointing mode's activation"
        " bytes per rank; with --device-memory also the longest sequence each strategy and mode fits",
    )
    parser.add_argument(
        "--sp",
        type=_positive_int,
        help="sequence parallelism (Ulysses) over groups of this many ranks, with --seq-len and a GPTModule --model:"
        " activations per rank hold each sample's slice, and the traffic and step time add attention's all-to-alls",
    )
    speed = parser.add_argument_group("step time (time_model.py): any of these adds the prediction")
    speed.add_argument("--cluster", choices=sorted(CLUSTERS), help="preset FLOP rate and link bandwidths")
    speed.add_argument("--tflops", type=_positive_float, help="achieved TFLOP/s per device")
    speed.add_argument("--intra-bw", type=_positive_float, help="GB/s one rank sends inside a node (bus bandwidth)")
    speed.add_argument("--inter-bw", type=_positive_float, help="GB/s one rank sends between nodes")
    speed.add_argument("--measure", action="store_true", help="measure FLOP rate and bandwidth here (--model GPT)")
    speed.add_argument("--tokens", type=_positive_int, help="tokens per rank per micro-batch (default: the config's)")
    return parser


def _sizes(parsed: argparse.Namespace) -> tuple[int, int, int | None]:
    """(world size, shard group size, device memory in bytes or None), each refused with its flag's name."""
    world = parsed.devices * parsed.nodes
    if world > MAX_ESTIMATE_RANKS:  # the table is computed rank by rank
        raise InputError(f"--devices x --nodes must be at most {MAX_ESTIMATE_RANKS:,} ranks, got {world:,}")
    try:
        shard = resolve_shard_size(parsed.shard_group_size, world_size=world, local_world_size=parsed.devices)
    except ValueError as error:
        raise InputError(f"argument --shard-group-size: {error}") from error
    try:
        capacity = parse_bytes(parsed.device_memory) if parsed.device_memory else None
    except ValueError as error:
        raise InputError(f"argument --device-memory: {error}") from error
    if parsed.nvme_bw is not None and parsed.offload != "nvme":
        raise InputError("argument --nvme-bw: needs --offload nvme (the configurations whose optimizer state is there)")
    if parsed.sp is not None and parsed.seq_len is None:
        raise InputError("argument --sp: needs --seq-len (the tokens per sample a group splits) and --model")
    for what, value in ((f"the {world} ranks (--devices x --nodes)", world), ("--seq-len", parsed.seq_len)):
        if parsed.sp is not None and value % parsed.sp:
            raise InputError(f"argument --sp: must divide {what}, {value}, got {parsed.sp}")
    return world, shard, capacity


def _sequence_parallel(parsed: argparse.Namespace, config: ZeroConfig) -> Ulysses | None:
    """``--sp``'s attention exchanges on one rank (comm_model.py), for a GPTModule config whose heads it divides;
    None without it (or with 1)."""
    if parsed.sp is None:
        return None
    gpt, batch = _gpt_of(parsed.model) if parsed.model else (None, None)
    if gpt is None:
        raise InputError("argument --sp: needs --model, a lightning_zero GPTModule config")
    try:
        check_heads(gpt.n_head, gpt.n_head, parsed.sp)
    except ValueError as error:
        raise InputError(f"argument --sp: {error}") from error
    if parsed.sp == 1:
        return None
    element = 4 if parsed.precision == "32-true" else 2  # (attention's inputs and output are autocast's dtype)
    heads, head_dim, mode = gpt.n_head, gpt.n_embd // gpt.n_head, config.activation_checkpointing
    return Ulysses(batch, parsed.seq_len, heads, heads, head_dim, parsed.sp, element, mode, gpt.n_layer)


def _print_exchanges(sequence: Ulysses) -> None:
    covered, k = sequence.layer_bytes() / 2**20, sequence.size
    print(
        f"sequence parallelism over groups of {k} ranks (Ulysses, zero.activation_checkpointing"
        f" {sequence.checkpointing}): each of the {sequence.layers} layers' all-to-alls cover {covered:.2f} MiB per"
        f" rank per micro-batch, {(k - 1) / k * covered:.2f} MiB of it sent to the group's other ranks (in the rows"
        " above)"
    )


def _print_memory(
    parsed: argparse.Namespace, psi: int, table: dict, world: int, shard: int, capacity: int | None
) -> None:
    """The per-rank table, and what ZeRO++'s secondary partition would add across nodes."""
    hybrid = f", sharded in groups of {shard} ranks (hybrid)" if shard < world else ""
    print(
        f"{psi:,} trainable parameters on {world} ranks ({parsed.devices} per node x {parsed.nodes} nodes),"
        f" precision {parsed.precision}{hybrid}; per rank (the rank that needs the most), GiB:"
    )
    print(format_table(table, capacity))
    if shard == world and parsed.nodes > 1:  # (ZeRO++'s secondary partition: stage 3's option across nodes)
        b = 2 if parsed.precision != "32-true" else 4
        extra = psi * b / parsed.devices
        print(
            f"zero3 with a secondary partition per node (ZeRO++'s hpZ, zero.secondary_partition): up to"
            f" {extra / 2**30:.2f} GiB more per rank, held between a forward and its backward"
        )


def _print_nvme_io(parsed: argparse.Namespace, table: dict) -> None:
    """What a step reads and writes on NVMe: the optimizer's chunks once each way, and with the parameters there each
    unit's shard at its forward and backward gathers (per micro-batch) and once written; with ``--nvme-bw``, how long
    that takes with the node's ranks sharing the drives."""
    state = max(r.nvme for r in table["zero3+nvme"])
    shards = max(r.nvme for r in table["zero3+nvme_param"]) - state
    reads, writes = state + 2 * parsed.micro_batches * shards, state + shards
    line = (
        f"on NVMe, per rank per step: {state / 2**30:.3f} GiB of optimizer state and gradients read and written;"
        f" with zero3+nvme_param also the shards: {reads / 2**30:.3f} GiB read, {writes / 2**30:.3f} GiB written"
    )
    if parsed.nvme_bw is not None:
        seconds = [moved * parsed.devices / (parsed.nvme_bw * 1e9) for moved in (2 * state, reads + writes)]
        line += f"; at {parsed.nvme_bw:g} GB/s per node: >= {seconds[0]:.3f} s, {seconds[1]:.3f} s with the shards"
    print(line)


def _print_fit(device_memory: str, table: dict, capacity: int, per_node: int, activations: bool) -> None:
    """The smallest configuration whose model states fit ``capacity`` bytes per device (with its host memory per
    node); ``activations``: they follow, counted."""
    fitting = smallest_fitting(table, capacity)
    verdict = f"the smallest configuration that fits: {fitting}" if fitting else "none fits: add devices or nodes"
    if fitting and table[fitting][0].host_total:
        host = max(r.host_total for r in table[fitting]) * per_node
        verdict += f" (host memory per node: {host / 2**30:.2f} GiB)"
    counted = "activations below" if activations else "activations not counted (--seq-len)"
    print(f"{device_memory} per device ({capacity:,} bytes), model states only, {counted}: {verdict}")


def _print_step_times(
    parsed: argparse.Namespace,
    psi: int,
    hardware: Hardware,
    world: int,
    shard: int,
    capacity: int | None,
    sequence: Ulysses | None,
) -> None:
    """The predicted step time of every strategy; tokens per rank and the model's shape from a GPT config when
    given, at ``--seq-len`` tokens per sample if given (a slice of each under ``sequence`` parallelism)."""
    gpt, batch = _gpt_of(parsed.model) if parsed.model else (None, None)
    length = (parsed.seq_len or gpt.block_size) if gpt else None
    tokens = parsed.tokens or (batch * length // (parsed.sp or 1) if gpt else 2048)
    shape3 = (gpt.n_layer, length, gpt.n_embd) if gpt else None
    links = {"world_size": world, "per_node": parsed.devices, "shard_size": shard, "sequence": sequence}
    print(
        format_step_times(
            psi,
            hardware,
            precision=parsed.precision,
            flops=flops_per_token(psi, shape3),
            tokens=tokens,
            capacity=capacity,
            micro_batches=parsed.micro_batches,
            **links,
        )
    )


def _activation_profile(parsed: argparse.Namespace) -> tuple:
    """What one micro-batch of ``--model`` saves, as a function of the sequence length, and its batch size."""
    from lightning_zero.planning.estimate_model import activation_profiler  # (jsonargparse's machinery: only here)

    if not parsed.model:
        raise InputError("argument --seq-len: needs --model (a config whose model takes token ids [batch, seq])")
    try:
        profile, batch = activation_profiler(parsed.model, parsed.sp or 1)
        profile(parsed.seq_len)
    except ValueError as error:
        raise InputError(f"argument --seq-len: {error}") from error
    return profile, batch


def _print_activations(parsed: argparse.Namespace, profile, batch: int, table: dict, capacity: int | None) -> None:
    """Activation bytes per rank at ``--seq-len`` for each checkpointing mode (planning/activations.py) and, with a
    device's memory, the longest sequence each strategy fits with each mode (its model states plus activations)."""
    at, gib, k = profile(parsed.seq_len), 2**30, parsed.sp or 1
    sliced = f", each rank {parsed.seq_len // k} tokens of each (--sp {k})" if k > 1 else ""
    title = f"activations per rank at {parsed.seq_len} tokens x {batch} samples{sliced}"
    print(f"{title} (zero.activation_checkpointing), GiB:")
    print(f"{'checkpointing':<20}{'device':>12}{'host':>12}")
    for mode, offload in MODES:
        device, host = at.held(mode, offload=offload)
        print(f"{mode_name(mode, offload):<20}{device / gib:>12.3f}{host / gib:>12.3f}")
    if capacity is None:
        return
    strategies = [name for name in table if "+" not in name]
    print(f"the longest sequence (tokens per sample) fitting {parsed.device_memory} per device with the model states")
    print("(counted as the model computes, whatever the length of a learned position table):")
    print(f"{'checkpointing':<20}" + "".join(f"{name:>12}" for name in strategies))
    for mode, offload in MODES:
        budgets = [capacity - max(r.total for r in table[name]) for name in strategies]
        longest = [longest_fitting(profile, budget, mode, offload, multiple=k) for budget in budgets]
        print(f"{mode_name(mode, offload):<20}" + "".join(f"{n:>12,}" if n else f"{'none':>12}" for n in longest))


def _hardware(parsed) -> Hardware | None:
    """The FLOP rate and bandwidths to predict with: measured, a preset, and flags over either."""
    if parsed.measure:
        if not parsed.model or parsed.nodes != 1:
            raise InputError("argument --measure: needs --model (a GPTModule config) and --nodes 1")
        gpt, batch = _gpt_of(parsed.model)
        if gpt is None:
            raise InputError(f"argument --measure: {parsed.model} is not a lightning_zero GPTModule config")
        at_length = dataclasses.replace(gpt, block_size=parsed.seq_len or gpt.block_size)
        base = measure_here(at_length, batch=batch, ranks=parsed.devices, sequence=parsed.sp or 1)
    elif parsed.cluster:
        base = CLUSTERS[parsed.cluster]
    elif any(v is not None for v in (parsed.tflops, parsed.intra_bw, parsed.inter_bw)):
        missing = [f"--{k}" for k in ("tflops", "intra-bw", "inter-bw") if getattr(parsed, k.replace("-", "_")) is None]
        if missing:
            raise InputError(f"the step time needs {', '.join(missing)} too (or --cluster / --measure)")
        return Hardware(tflops=parsed.tflops, intra_gbs=parsed.intra_bw, inter_gbs=parsed.inter_bw)
    else:
        return None
    overrides = {"tflops": parsed.tflops, "intra_gbs": parsed.intra_bw, "inter_gbs": parsed.inter_bw}
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})


def _gpt_of(path: str):
    """(GPTConfig, batch size) of a config whose model is lightning_zero's GPTModule, else (None, None)."""
    from lightning_zero.models.gpt import GPTConfig
    from lightning_zero.planning.estimate_model import read_config

    raw = read_config(path)
    if not str(raw["model"].get("class_path", "")).endswith("GPTModule"):
        return None, None
    model = (raw["model"].get("init_args") or {}).get("model") or {}
    batch = ((raw.get("data") or {}).get("init_args") or {}).get("batch_size", 1)
    return GPTConfig(**model), int(batch)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def _shard_group_size(text: str) -> int | str:
    if text == "node":
        return text
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f'must be "node" or an integer >= 1, got {text!r}') from None


def _shape_of_model(path: str):
    from lightning_zero.planning.estimate_model import shape_of_config  # imports jsonargparse's machinery: only here

    try:
        return shape_of_config(path)
    except OSError as error:
        raise InputError(f"argument --model: {path}: {error.strerror or error}") from error
    except (ValueError, TypeError, MisconfigurationException) as error:  # not a config, or its model, its
        # optimizers or its zero options are refused
        raise InputError(f"argument --model: {error}") from error
