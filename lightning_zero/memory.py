"""The ZeRO memory formulas for what this implementation allocates per rank.

For Psi trainable parameters over N ranks, with Adam, every rank holds (B = bytes per parameter and
gradient element: 4 with fp32 parameters, i.e. ``32-true`` and ``bf16-mixed`` whose autocast keeps
fp32 weights; 2 with ``16-mixed``):

=========  ===========  ==========  ==================  ==================================
strategy   parameters   gradients   master + Adam (K)   total
=========  ===========  ==========  ==================  ==================================
ddp        B Psi        B Psi       8 Psi (no master)   (fp32) 16 Psi
zero1      B Psi        B Psi       12 Psi / N          fp32: 8 Psi + 12 Psi / N; fp16: 4 Psi + 12 Psi / N
zero2      B Psi        B Psi / N   12 Psi / N          fp32: 4 Psi + 16 Psi / N; fp16: 2 Psi + 14 Psi / N
zero3      B Psi / N    B Psi / N   (12 or 8) Psi / N   16 Psi / N (fp32: the shard is the master)
=========  ===========  ==========  ==================  ==================================

The master copy is the fp32 partition the optimizer steps (DeepSpeed keeps one too); with fp32
parameters it costs 4 Psi / N more than DDP's in-place update, and buys one code path for all
precisions. Padding adds fewer than 2N elements per bucket. Transient, not counted: stage 2's
in-flight buckets, and at the step the fp32 copy of a 16-bit gradient partition (4 Psi / N) and
stage 1's reduced partition (B Psi / N).
"""

from __future__ import annotations


def formula_bytes(strategy: str, psi: int, world_size: int, param_bytes: int = 4) -> dict[str, float]:
    """Per-rank bytes by category for ``strategy`` in ("ddp", "zero1", "zero2", "zero3") with Adam.

    ``param_bytes`` is 4 for fp32 parameters and 2 for fp16 ones (``16-mixed``).
    """
    n, b = world_size, param_bytes
    if strategy == "ddp":
        return {"parameters": b * psi, "gradients": b * psi, "optimizer_state": 8 * psi}
    if strategy == "zero1":
        return {"parameters": b * psi, "gradients": b * psi, "optimizer_state": 12 * psi / n}
    if strategy == "zero2":
        return {"parameters": b * psi, "gradients": b * psi / n, "optimizer_state": 12 * psi / n}
    if strategy == "zero3":  # with fp32 parameters the parameter shard is the master: K = 8
        return {"parameters": b * psi / n, "gradients": b * psi / n, "optimizer_state": (12 if b == 2 else 8) * psi / n}
    raise ValueError(f"strategy must be one of ddp, zero1, zero2, zero3, got {strategy!r}")
