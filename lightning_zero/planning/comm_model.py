"""Communication per optimizer step: what each process group carries, and what crosses the nodes.

[Note: the communication model]
``step_collectives`` gives the bytes of the buffers each kind of collective covers on one rank per
optimizer step (what ``collectives.Traffic.bytes_by_group`` counts, by group role), from the padded model size
``total`` (elements), the bytes per gradient and per parameter element, the micro-batches per step and
the shard group size K (K = N without hybrid sharding, where the "shard" group is the world):

    ddp    all-reduce  Bg * total                       (once per step: no_sync while accumulating)
    zero1  reduce-scatter Bg * total, all-gather Bp * total            (both once per step)
    zero2  reduce-scatter Bg * total per micro-batch, all-gather Bp * total
    zero3  reduce-scatter Bg * total and all-gathers of at most 2 Bp * total per micro-batch (forward and
           backward; the root unit and the persistent units are gathered once, so measured runs send less)
    hybrid (R = N / K replicas) adds, on the replicate group, an all-reduce of the partition: Bg * total / K
    ZeRO++ (zero3, nodes of K ranks, int8 blocks of b elements with a 4-byte scale each, q = 1 + 4 / b):
           qwZ    the world's all-gathers send q * total bytes instead of Bp * total
           hpZ    the backward's all-gather of Bp * total moves to the node group
           qgZ    the reduce-scatter of Bg * total moves to the node group, and an all-to-all of the node's
                  partial sums, q * total / K bytes, crosses the nodes (the "cross" group; with 4 bits
                  (1/2 + 4 / b) * total / K)
    sequence parallelism (Ulysses, ``Ulysses``: groups of K consecutive ranks, the "sequence" group; ZeRO's
           collectives above stay over all N ranks) adds per layer and micro-batch all-to-alls of q, k, v and the
           attention's output, each covering this rank's B x S/K positions of its heads:
               B * S/K * D * (2 H + 2 H_kv') * e bytes,  H_kv' = max(H_kv, K)
           (H query and H_kv key/value heads of D elements, e bytes each; key/value heads are split when K divides
           them, else repeated to one per rank: ulysses.py). Backward runs the opposite exchanges (the same bytes)
           and activation checkpointing ("units" or "selective") the forward's again in its recomputation:
           (2 + [checkpointing]) times that per layer.

``link_bytes`` turns buffers into bytes sent per rank by a ring collective over the group (a
reduce-scatter or all-gather sends (n - 1) / n of the buffer, an all-reduce twice that) and splits them
by link: the share of the ring's hops (ranks in order, the last back to the first) that join two nodes
of ``per_node`` consecutive ranks goes to the inter-node link. NCCL's trees and in-network reductions
move the same bytes in other shapes; this is the ring's count, which is what the ZeRO paper's volume
analysis uses. ``algorithm="direct"`` counts our collectives on gloo instead (collectives.py's [Note:
per-backend collectives]): each rank sends its 1/n of a reduce-scatter or all-gather to each peer directly,
so a peer on another node costs the inter-node link 1/n of the buffer. An all-to-all sends the same way under
either algorithm (NCCL's is pairwise too): (n - 1) / n of its buffer leaves the rank, 1/n to each peer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

GROUP_OPS = {"reduce_scatter": 1, "all_gather": 1, "all_reduce": 2, "all_to_all": 1}  # sent: factor * (n-1)/n * buffer
ZERO_PLUS_PLUS = ("qwZ", "hpZ", "qgZ")


@dataclass(frozen=True)
class Ulysses:
    """Sequence parallelism's attention exchanges on one rank (see the Note): ``batch`` samples of ``seq_len`` tokens
    per micro-batch over a group of ``size`` ranks, ``layers`` attentions of ``heads`` query and ``kv_heads``
    key/value heads of ``head_dim`` elements, ``element_bytes`` each, and the activation ``checkpointing`` mode."""

    batch: int
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    size: int
    element_bytes: int = 4
    checkpointing: str = "none"
    layers: int = 1

    def forward_bytes(self) -> int:
        """What one layer's forward exchanges cover: q, k, v (key/value heads split or repeated) and the output."""
        kv_heads = max(self.kv_heads, self.size)
        positions = self.batch * (self.seq_len // self.size)
        return positions * self.head_dim * (2 * self.heads + 2 * kv_heads) * self.element_bytes

    def layer_bytes(self) -> int:
        """Buffer bytes per layer and micro-batch: the forward's, backward's and a recomputation's exchanges."""
        return (2 + (self.checkpointing != "none")) * self.forward_bytes()

    def exchanges(self) -> int:
        """All-to-alls per micro-batch: 4 a layer's forward (q, k, v, output), 4 its backward, 4 a recomputation."""
        return 4 * (2 + (self.checkpointing != "none")) * self.layers


def step_collectives(
    strategy: str,
    total: int,
    *,
    world_size: int,
    shard_size: int | None = None,
    grad_bytes: int = 4,
    param_bytes: int = 4,
    micro_batches: int = 1,
    zero_plus_plus: tuple[str, ...] = (),
    node_size: int = 2,
    block: int = 256,
    gradient_bits: int = 8,
    sequence: Ulysses | None = None,
) -> dict[tuple[str, str], float]:
    """Buffer bytes per (group role, collective) one rank covers per optimizer step (see the Note);
    ``zero_plus_plus``: some of ``ZERO_PLUS_PLUS`` (zero3), over nodes of ``node_size`` ranks; ``sequence``: the
    attention's all-to-alls under sequence parallelism."""
    shard_size = world_size if shard_size is None else shard_size
    grads, params = grad_bytes * total, param_bytes * total
    if strategy == "ddp":
        out = {("world", "all_reduce"): grads}
    elif zero_plus_plus:
        options = set(zero_plus_plus)
        out = _zero_plus_plus(options, total, grads, params, micro_batches, node_size, block, gradient_bits)
    else:
        out = _sharded(strategy, grads, params, micro_batches, world_size, shard_size)
    if sequence is not None and sequence.size > 1:
        out["sequence", "all_to_all"] = sequence.layers * sequence.layer_bytes() * micro_batches
    return out


def _sharded(
    strategy: str, grads: float, params: float, micro_batches: int, world_size: int, shard_size: int
) -> dict[tuple[str, str], float]:
    role = "shard" if shard_size < world_size else "world"
    per_micro = {"zero1": 0, "zero2": 1, "zero3": 1}[strategy]
    out = {
        (role, "reduce_scatter"): grads * (micro_batches if per_micro else 1),
        (role, "all_gather"): params * (2 * micro_batches if strategy == "zero3" else 1),
    }
    if shard_size < world_size:
        out["replicate", "all_reduce"] = grads / shard_size
    return out


def _zero_plus_plus(
    options: set[str],
    total: int,
    grads: float,
    params: float,
    micro_batches: int,
    node_size: int,
    block: int,
    gradient_bits: int,
) -> dict[tuple[str, str], float]:
    unknown = options - set(ZERO_PLUS_PLUS)
    if unknown:
        raise ValueError(f"zero_plus_plus must hold some of {', '.join(ZERO_PLUS_PLUS)}, got {sorted(unknown)}")
    quantized = (1 + 4 / block) * total  # int8 values and a float scale per block
    forward = quantized if "qwZ" in options else params
    out: dict[tuple[str, str], float] = {}
    for key, size in (
        (("world", "all_gather"), forward),
        (
            ("node", "all_gather") if "hpZ" in options else ("world", "all_gather"),
            params if "hpZ" in options else forward,
        ),
        (("node", "reduce_scatter") if "qgZ" in options else ("world", "reduce_scatter"), grads),
    ):
        out[key] = out.get(key, 0.0) + size * micro_batches
    if "qgZ" in options:
        packed = (gradient_bits / 8 + 4 / block) * total  # int4: two values a byte
        out["cross", "all_to_all"] = packed / node_size * micro_batches
    return out


def ring_inter_fraction(ranks: Sequence[int], per_node: int) -> float:
    """The share of a ring's hops over ``ranks`` (in order, the last back to the first) between two nodes."""
    n = len(ranks)
    if n <= 1:
        return 0.0
    return sum(ranks[i] // per_node != ranks[(i + 1) % n] // per_node for i in range(n)) / n


def group_ranks(role: str, *, world_size: int, shard_size: int, per_node: int = 1, sequence_size: int = 1) -> list[int]:
    """The ranks of rank 0's group of ``role`` (every group of a role has the same shape)."""
    if role == "world":
        return list(range(world_size))
    if role == "shard":
        return list(range(shard_size))
    if role == "sequence":
        return list(range(sequence_size))
    if role == "node":
        return list(range(per_node))
    if role == "cross":
        return list(range(0, world_size, per_node))
    return list(range(0, world_size, shard_size))  # replicate


def direct_inter_fraction(ranks: Sequence[int], per_node: int) -> float:
    """The share of what the first of ``ranks`` sends directly to each other one that crosses nodes."""
    if len(ranks) <= 1:
        return 0.0
    return sum(r // per_node != ranks[0] // per_node for r in ranks[1:]) / (len(ranks) - 1)


def link_bytes(
    collectives: dict[tuple[str, str], float],
    *,
    world_size: int,
    per_node: int,
    shard_size: int | None = None,
    algorithm: str = "ring",
    sequence_size: int = 1,
) -> tuple[float, float]:
    """(intra-node, inter-node) bytes one rank sends per step for ``collectives`` (``step_collectives``), by
    ring collectives or, ``algorithm="direct"``, by ours on gloo (see the Note); sequence groups of
    ``sequence_size`` ranks."""
    if algorithm not in ("ring", "direct"):
        raise ValueError(f"algorithm must be ring or direct, got {algorithm!r}")
    shard_size = world_size if shard_size is None else shard_size
    intra = inter = 0.0
    for (role, op), size in collectives.items():
        ranks = group_ranks(
            role, world_size=world_size, shard_size=shard_size, per_node=per_node, sequence_size=sequence_size
        )
        n = len(ranks)
        sent = GROUP_OPS[op] * (n - 1) / n * size
        direct = op == "all_to_all" or (algorithm == "direct" and op != "all_reduce")
        share = (direct_inter_fraction if direct else ring_inter_fraction)(ranks, per_node)
        inter += sent * share
        intra += sent * (1 - share)
    return intra, inter


def format_traffic(
    psi: int,
    precision: str,
    *,
    world: int,
    per_node: int,
    shard_size: int,
    micro_batches: int = 1,
    sequence: Ulysses | None = None,
) -> str:
    """Bytes one rank sends per optimizer step, inside nodes and between them, for each strategy (ring
    collectives; zero3's all-gathers at their bound), with ``sequence`` parallelism's all-to-alls."""
    b = 2 if precision == "16-mixed" else 4
    title = f"sent per rank per step ({micro_batches} micro-batches), GB"
    lines = [f"{title:<56}{'intra-node':>12}{'inter-node':>12}"]
    common = {"world_size": world, "micro_batches": micro_batches, "sequence": sequence}
    links = {"world_size": world, "per_node": per_node, "sequence_size": sequence.size if sequence else 1}
    for name in ("ddp", "zero1", "zero2", "zero3"):
        size, grad = (world, 4) if name == "ddp" else (shard_size, b)  # ddp reduces fp32 gradients
        ops = step_collectives(name, psi, shard_size=size, grad_bytes=grad, param_bytes=b, **common)
        intra, inter = link_bytes(ops, shard_size=size, **links)
        lines.append(f"{name:<56}{intra / 1e9:>12.3f}{inter / 1e9:>12.3f}")
    if shard_size == world and per_node < world:  # ZeRO++ over the nodes (with hybrid sharding it is refused)
        ops = step_collectives(
            "zero3", psi, grad_bytes=b, param_bytes=b, zero_plus_plus=ZERO_PLUS_PLUS, node_size=per_node, **common
        )
        intra, inter = link_bytes(ops, **links)
        lines.append(f"{'zero3 + qwZ + hpZ + qgZ (ZeRO++)':<56}{intra / 1e9:>12.3f}{inter / 1e9:>12.3f}")
    return "\n".join(lines)
