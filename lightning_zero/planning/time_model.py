"""A step-time model for ``lightning-zero estimate``: compute at a FLOP rate, communication over two
links, and how much of it stays exposed; and the largest model each configuration fits.

[Note: the step-time model]
Per rank and optimizer step, for ``tokens`` tokens per rank per micro-batch and M micro-batches:

    compute   = flops_per_token * tokens * M / FLOP rate, with flops_per_token = 6 Psi (forward 2,
                backward 4 per parameter) + 12 n_layer T d when the model's shape is known (attention;
                nanoGPT's and PaLM's count). Under sequence parallelism (comm_model's ``Ulysses``, groups of
                K ranks) a rank's tokens are its slices, B S / K, and T is the whole sequence S: the rank
                runs attention for H / K heads over all S positions, S / K positions' worth of every head
    links     = comm_model.link_bytes / bandwidth of each link (intra-node, inter-node; bytes per second
                one rank sends, i.e. NCCL's "bus bandwidth"), and for sequence parallelism's exchanges
                (many, each small: a layer's q, k, v and output) their count times a small all-to-all's time
    exposed   = what compute cannot hide: ddp's all-reduce and ZeRO-1/2's reduce-scatters overlap the
                backward (2/3 of compute), ZeRO-1/2's all-gathers the next forward (1/3), stage 3's
                prefetched gathers and reductions share all of it; hybrid sharding's replica all-reduce
                runs at the step, and sequence parallelism's all-to-alls between a layer's projections and
                its attention (which waits for them), so neither is ever hidden. The communication that
                shares a window is exposed by max(0, its time - the window).
    step      = compute + exposed

``measure`` takes the inputs from this machine: the FLOP rate that a model's training step (forward,
backward and the whole model's AdamW update, counted as the model's FLOPs) reaches on every rank at
once, so cores shared between ranks count as they do in training (under sequence parallelism the step of
one rank of a group, its exchanges' layout copies made locally), the bus bandwidth of a gloo all-reduce
between the ranks (on one machine both links are that loopback) and a small all-to-all's time. The
framework's own time per step (Lightning's loop, ZeRO's bucket copies) is not modelled, nor the waits of
ranks whose work between two exchanges takes different times.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_zero.planning.comm_model import ZERO_PLUS_PLUS, Ulysses, link_bytes, step_collectives
from lightning_zero.planning.memory import formula_bytes


@dataclass(frozen=True)
class Hardware:
    """What one rank gets: achieved TFLOP/s and bus bandwidth (GB/s) inside a node and between nodes, and what a
    small all-to-all takes (microseconds: its start and the ranks meeting; 0 where not measured)."""

    tflops: float
    intra_gbs: float
    inter_gbs: float
    all_to_all_us: float = 0.0

    def __post_init__(self) -> None:
        for key in ("tflops", "intra_gbs", "inter_gbs"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{key} must be a number > 0, got {value!r}")
        if not isinstance(self.all_to_all_us, (int, float)) or not self.all_to_all_us >= 0:
            raise ValueError(f"all_to_all_us must be a number >= 0, got {self.all_to_all_us!r}")


# Presets: half the dense 16-bit peak (a good MFU), NCCL all-reduce bus bandwidth inside the node, and one
# 200 / 400 Gb/s InfiniBand NIC per GPU at about 90% between nodes.
CLUSTERS = {
    "dgx-a100": Hardware(tflops=156.0, intra_gbs=230.0, inter_gbs=22.0),
    "dgx-h100": Hardware(tflops=495.0, intra_gbs=360.0, inter_gbs=45.0),
}


@dataclass(frozen=True)
class StepTime:
    """One rank's optimizer step, in seconds (see [Note: the step-time model]): its compute, its communication over
    each link (intra-node, inter-node) and the part of that communication that compute does not hide."""

    compute: float
    intra: float  # seconds of intra-node communication
    inter: float
    exposed: float

    @property
    def total(self) -> float:
        """The step time: compute plus the exposed communication."""
        return self.compute + self.exposed


def flops_per_token(psi: int, shape: tuple[int, int, int] | None = None) -> float:
    """6 Psi, plus attention's 12 n_layer T d with ``shape`` = (n_layer, T, d)."""
    return 6 * psi + (12 * shape[0] * shape[1] * shape[2] if shape else 0)


def predict_step(
    strategy: str,
    psi: int,
    hardware: Hardware,
    *,
    tokens: int,
    world_size: int,
    per_node: int,
    shard_size: int | None = None,
    micro_batches: int = 1,
    grad_bytes: int = 4,
    param_bytes: int = 4,
    flops: float | None = None,
    algorithm: str = "ring",
    zero_plus_plus: tuple[str, ...] = (),
    block: int = 256,
    sequence: Ulysses | None = None,
) -> StepTime:
    """The step time of one rank (see [Note: the step-time model]) for ``tokens`` per micro-batch (with
    ``sequence`` parallelism its slices'); ``flops`` per token, default 6 Psi, with ``sequence`` plus its
    attention's; ``algorithm`` and ``zero_plus_plus`` as in comm_model.py (ZeRO++ over nodes of ``per_node``)."""
    if flops is None:
        shape = (sequence.layers, sequence.seq_len, sequence.heads * sequence.head_dim) if sequence else None
        flops = flops_per_token(psi, shape)
    compute = flops * tokens * micro_batches / (hardware.tflops * 1e12)
    shard_size = world_size if strategy == "ddp" or shard_size is None else shard_size
    ops = step_collectives(
        strategy,
        psi,
        world_size=world_size,
        shard_size=shard_size,
        grad_bytes=grad_bytes,
        param_bytes=param_bytes,
        micro_batches=micro_batches,
        zero_plus_plus=zero_plus_plus,
        node_size=per_node,
        block=block,
        sequence=sequence,
    )
    groups = {"world_size": world_size, "per_node": per_node, "shard_size": shard_size, "algorithm": algorithm}
    groups["sequence_size"] = sequence.size if sequence else 1
    intra = inter = 0.0
    busy: dict[float, float] = {}  # compute window -> seconds of communication that must fit in it
    for (role, op), size in ops.items():
        a, b = link_bytes({(role, op): size}, **groups)
        intra, inter = intra + a / (hardware.intra_gbs * 1e9), inter + b / (hardware.inter_gbs * 1e9)
        if role in ("replicate", "sequence"):
            window = 0.0  # at the step, after the last backward; or on the critical path
        elif strategy == "zero3":
            window = compute  # prefetched gathers and per-unit reductions share all of compute
        else:  # reductions during backward, gathers during the next forward
            window = compute * (2 / 3 if op in ("reduce_scatter", "all_reduce") else 1 / 3)
        busy[window] = busy.get(window, 0.0) + a / (hardware.intra_gbs * 1e9) + b / (hardware.inter_gbs * 1e9)
    if sequence is not None:  # each exchange's start and meeting, on the critical path too
        starts = sequence.exchanges() * micro_batches * hardware.all_to_all_us * 1e-6
        intra, busy[0.0] = intra + starts, busy.get(0.0, 0.0) + starts
    exposed = sum(max(0.0, seconds - window) for window, seconds in busy.items())
    return StepTime(compute, intra, inter, exposed)


def largest_psi(strategy: str, capacity: int, *, shard_size: int, param_bytes: int) -> int:
    """The most parameters whose states (Adam, no activations) fit ``capacity`` bytes per device."""
    per_parameter = sum(v for k, v in formula_bytes(strategy, 1, shard_size, param_bytes).items() if "host" not in k)
    return int(capacity // per_parameter)


def measure_compute(step: Callable[[], None], flops: float, *, repeats: int = 5) -> float:
    """Achieved TFLOP/s of ``step`` (a forward and backward worth ``flops``): median of ``repeats`` after one."""
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return flops / sorted(times)[len(times) // 2] / 1e12


def measure_bus_bandwidth(numel: int = 4_000_000, repeats: int = 5, group=None) -> float:
    """GB/s one rank sends in a ring all-reduce of ``numel`` fp32 elements (NCCL's bus bandwidth)."""
    import torch.distributed as dist

    buffer = torch.ones(numel)
    n = dist.get_world_size(group)
    dist.all_reduce(buffer, group=group)
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_reduce(buffer, group=group)
        times.append(time.perf_counter() - start)
    return 2 * (n - 1) / n * buffer.nbytes / sorted(times)[len(times) // 2] / 1e9


def measure_all_to_all_us(numel: int = 256, repeats: int = 21, group=None) -> float:
    """Microseconds of a small all-to-all (``numel`` fp32 elements per rank) of ``group``: its start and the ranks
    meeting, which every exchange pays beside its bytes (the median of ``repeats``)."""
    import torch.distributed as dist

    send, received = torch.ones(numel * dist.get_world_size(group)), torch.empty(numel * dist.get_world_size(group))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dist.all_to_all_single(received, send, group=group)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e6


def _measure_worker(rank: int, world: int, gpt_config, batch: int, sequence: int, out_file: str) -> None:
    import json

    from lightning_zero.models.gpt import GPT
    from lightning_zero.planning.activations import profiled_rank

    torch.set_num_threads(max(1, (torch.get_num_threads() or 1) // world))
    # a rank's work under sequence parallelism: its slices, attention over the whole sequence for its heads, and
    # the exchanges' layout copies (the profile's stand-in makes them, without communicating)
    model = GPT(gpt_config, sequence=profiled_rank(sequence) if sequence > 1 else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(gpt_config.vocab_size, (batch, gpt_config.block_size // sequence + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:  # what a training step computes: forward, backward and the optimizer's update
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    psi = sum(p.numel() for p in model.parameters())
    shape = (gpt_config.n_layer, gpt_config.block_size, gpt_config.n_embd)
    tflops = measure_compute(step, flops_per_token(psi, shape) * x.numel())
    bandwidth, latency = measure_bus_bandwidth(), measure_all_to_all_us()
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump({"tflops": tflops, "gbs": bandwidth, "all_to_all_us": latency}, f)


def measure_here(gpt_config, *, batch: int, ranks: int, sequence: int = 1) -> Hardware:
    """The FLOP rate a GPT's forward and backward reach on ``ranks`` local processes at once (rank 0's; as one rank
    of a ``sequence``-parallel group: ``batch`` slices), their gloo all-reduce bus bandwidth and a small
    all-to-all's time, as the Hardware of this machine (both links are loopback here)."""
    import json
    import tempfile
    from pathlib import Path

    from lightning_zero.launch_local import spawn_local_ranks

    with tempfile.TemporaryDirectory() as tmp:
        out_file = str(Path(tmp) / "measured.json")
        spawn_local_ranks(_measure_worker, ranks, gpt_config, batch, sequence, out_file)
        measured = json.loads(Path(out_file).read_text())
    gbs = measured["gbs"]
    return Hardware(tflops=measured["tflops"], intra_gbs=gbs, inter_gbs=gbs, all_to_all_us=measured["all_to_all_us"])


def format_step_times(
    psi: int, hardware: Hardware, *, precision: str, flops: float, tokens: int, capacity: int | None, **links
) -> str:
    """The predicted step of every strategy (and with ``capacity``, the largest model whose states fit)."""
    b = 2 if precision == "16-mixed" else 4
    lines = [
        f"predicted step per rank ({tokens:,} tokens per micro-batch; {hardware.tflops:.3g} TFLOP/s, "
        f"{hardware.intra_gbs:.3g} / {hardware.inter_gbs:.3g} GB/s intra / inter"
        + (f", a small all-to-all {hardware.all_to_all_us:.0f} us" if hardware.all_to_all_us else "")
        + "), s (time_model.py)",
        f"{'strategy':<12}{'compute':>10}{'intra':>10}{'inter':>10}{'exposed':>10}{'step':>10}"
        + (f"{'largest model':>16}" if capacity else ""),
    ]
    shard = links.get("shard_size") or links["world_size"]
    rows = [(name, name, ()) for name in ("ddp", "zero1", "zero2", "zero3")]
    if shard == links["world_size"] and links["per_node"] < links["world_size"]:  # ZeRO++ over the nodes
        rows.append(("zero3++", "zero3", ZERO_PLUS_PLUS))
    for label, name, plus in rows:
        grad = 4 if name == "ddp" else b  # ddp reduces fp32 gradients under every precision
        kwargs = dict(tokens=tokens, grad_bytes=grad, param_bytes=b, flops=flops, zero_plus_plus=plus)
        t = predict_step(name, psi, hardware, **kwargs, **links)
        fits = ""
        if capacity:
            size = links["world_size"] if name == "ddp" else shard
            fits = f"{largest_psi(name, capacity, shard_size=size, param_bytes=b) / 1e9:>14.2f}B"
        lines.append(
            f"{label:<12}{t.compute:>10.3f}{t.intra:>10.3f}{t.inter:>10.3f}{t.exposed:>10.3f}{t.total:>10.3f}{fits}"
        )
    if len(rows) > 4:
        lines.append("zero3++: zero3 with quantized weights, a secondary partition per node and quantized gradients")
    return "\n".join(lines)
