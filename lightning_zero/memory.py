"""The ZeRO memory formulas for what this implementation allocates per rank.

With fp32 parameters (``32-true`` and ``bf16-mixed``, whose autocast keeps fp32 weights) every rank
holds, for Psi trainable parameters over N ranks:

=========  ===========  ==========  ==================  ========================
strategy   parameters   gradients   master + Adam (K)   total
=========  ===========  ==========  ==================  ========================
ddp        4 Psi        4 Psi       8 Psi (no master)   16 Psi
zero1      4 Psi        4 Psi       12 Psi / N          8 Psi + 12 Psi / N
zero2      4 Psi        4 Psi / N   12 Psi / N          4 Psi + 16 Psi / N
=========  ===========  ==========  ==================  ========================

The master copy is the fp32 partition the optimizer steps (DeepSpeed keeps one too); with fp32
parameters it costs 4 Psi / N more than DDP's in-place update, and buys one code path for all
precisions. Padding adds fewer than 2N elements per bucket.
"""

from __future__ import annotations


def formula_bytes(strategy: str, psi: int, world_size: int) -> dict[str, float]:
    """Per-rank bytes by category for ``strategy`` in ("ddp", "zero1", "zero2"), fp32 parameters, Adam."""
    n = world_size
    if strategy == "ddp":
        return {"parameters": 4 * psi, "gradients": 4 * psi, "optimizer_state": 8 * psi}
    if strategy == "zero1":
        return {"parameters": 4 * psi, "gradients": 4 * psi, "optimizer_state": 12 * psi / n}
    if strategy == "zero2":
        return {"parameters": 4 * psi, "gradients": 4 * psi / n, "optimizer_state": 12 * psi / n}
    raise ValueError(f"strategy must be one of ddp, zero1, zero2, got {strategy!r}")
