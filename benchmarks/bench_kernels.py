"""Times every fused kernel against torch eager and torch.compile (and fused AdamW against torch's
fused AdamW) with CUDA events, in one run next to a device-to-device copy that gives the machine's
bandwidth; reports GB/s, % of copy bandwidth and speedups, the fused GPT block against the plain one,
and cold and warm compile times. ``--dry-run`` runs every path once on the CPU with tiny sizes (no
timings worth reading): it checks the script, not the kernels.

    python benchmarks/bench_kernels.py --out benchmarks/results/kernels_h200.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from common import emit

from lightning_zero.kernels import loader, ops
from lightning_zero.kernels.adamw import fused_adamw_
from lightning_zero.models.gpt import GPT, GPTConfig


def timed(fn: Callable[[], object], device: str, reps: int) -> float:
    """Median seconds per call after warm-up (CUDA events on a GPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def fwd_bwd(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> Callable[[], None]:
    grad = None

    def run() -> None:
        nonlocal grad
        for t in inputs:
            t.grad = None
        out = fn(*inputs)
        grad = torch.ones_like(out) if grad is None else grad
        out.backward(grad)

    return run


def cases(device: str, dtype: torch.dtype, scale: int) -> list[tuple[str, Callable, Callable, list, int]]:
    """(name, fused fn, eager fn, inputs, bytes moved by fwd + bwd with each input read once and each
    output written once)."""
    r, c = 8192 // scale, 4096 // scale
    x = torch.randn(r, c, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(c, device=device, requires_grad=True)
    b = torch.randn(c, device=device, requires_grad=True)
    res = torch.randn(r, c, device=device, dtype=dtype, requires_grad=True)
    h = torch.randn(r, 4 * c, device=device, dtype=dtype, requires_grad=True)
    b4 = torch.randn(4 * c, device=device, requires_grad=True)
    s = torch.randn(
        8 // min(scale, 8), 16, 1024 // scale, 1024 // scale, device=device, dtype=dtype, requires_grad=True
    )
    vit = torch.randn(  # ViT-B/16's attention: 197 keys, rows that are not whole 16-byte packs
        64 // scale, 12, 197, 197, device=device, dtype=dtype, requires_grad=True
    )
    e = x.element_size()
    causal = torch.ones(s.shape[-2:], dtype=torch.bool, device=device).triu(1)
    return [
        (
            "layer_norm",
            lambda x, w, b: ops.layer_norm(x, w, b),
            lambda x, w, b: F.layer_norm(x, (c,), w.to(x.dtype), b.to(x.dtype)),
            [x, w, b],
            x.numel() * e * 5,
        ),  # fwd: x -> y; bwd: dy, x -> dx
        (
            "bias_gelu",
            lambda h, b: ops.bias_gelu(h, b),
            lambda h, b: F.gelu(h + b.to(h.dtype), approximate="tanh"),
            [h, b4],
            h.numel() * e * 5,
        ),  # fwd: h -> y; bwd: dy, h -> dh, dh -> dbias
        (
            "softmax_causal",
            lambda s: ops.softmax_dropout(s, 0.125, causal=True),
            lambda s: torch.softmax((s * 0.125).masked_fill(causal, float("-inf")), dim=-1),
            [s],
            s.numel() * e * 5,
        ),
        (
            "softmax_197_keys",
            lambda v: ops.softmax_dropout(v, 0.125),
            lambda v: torch.softmax(v * 0.125, dim=-1),
            [vit],
            vit.numel() * e * 5,
        ),
        (
            "bias_dropout_residual",
            lambda x, b, r: ops.bias_dropout_residual(x, b, r, p=0.1, seed=1),
            lambda x, b, r: r + F.dropout(x + b.to(x.dtype), 0.1),
            [x, b, res],
            x.numel() * e * 6,
        ),
        (  # the sum of both outputs costs the same in both columns; it is not counted in the bytes
            "bias_dropout_residual_layer_norm",
            lambda x, b, r, w, lb: sum(ops.bias_dropout_residual_layer_norm(x, b, r, w, lb, p=0.1)),
            lambda x, b, r, w, lb: _residual_layer_norm_eager(x, b, r, w, lb, c),
            [x, b, res, w, b.detach().clone().requires_grad_()],
            x.numel() * e * 9,
        ),  # fwd: x, res -> hidden, normed; bwd: dnormed, dhidden, hidden -> dx, dresidual
    ]


def _residual_layer_norm_eager(x, b, r, w, lb, c: int) -> torch.Tensor:
    hidden = r + F.dropout(x + b.to(x.dtype), 0.1)
    return hidden + F.layer_norm(hidden, (c,), w.to(x.dtype), lb.to(x.dtype))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, one repetition")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    scale, reps = (64, 1) if args.dry_run else (1, args.reps)
    lines = [f"# Fused kernels, {datetime.date.today().isoformat()}", ""]
    lines += _compile_times() if device == "cuda" else ["- DRY RUN on the CPU: references only, timings meaningless"]
    src = torch.empty(2**28 // scale**2, device=device)
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.nbytes / timed(lambda: dst.copy_(src), device, reps) / 1e9
    lines += [
        f"- device-to-device copy: {copy_gbs:.0f} GB/s (read + write)",
        "",
        "| op | dtype | fused ms | GB/s | % of copy | eager ms | compiled ms | vs eager | vs compile |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for dtype in (torch.float32, torch.bfloat16):
        for case in cases(device, dtype, scale):
            lines.append(_case_row(case, dtype, device, reps, copy_gbs, compile_too=not args.dry_run))
    lines += ["", _adamw_line(device, scale, reps, copy_gbs), _gpt_block_line(device, scale, reps)]
    lines.append(f"\ncommand: `python benchmarks/bench_kernels.py {' '.join(sys.argv[1:])}`")
    emit("\n".join(lines) + "\n", args.out)


def _compile_times() -> list[str]:
    """The device, and the time to compile every kernel cold (an empty CuPy cache) and warm (from disk)."""
    props = torch.cuda.get_device_properties(0)
    lines = [f"- device: {props.name}, torch {torch.__version__}, CuPy kernels: {loader.available()}"]
    os.environ["CUPY_CACHE_DIR"] = tempfile.mkdtemp()
    loader._module.cache_clear()
    began = time.perf_counter()
    loader.compile_all()
    cold = time.perf_counter() - began
    loader._module.cache_clear()
    began = time.perf_counter()
    loader.compile_all()
    lines.append(f"- compile all kernels: cold {cold:.2f} s, warm (disk cache) {time.perf_counter() - began:.2f} s")
    return lines


def _case_row(case: tuple, dtype: torch.dtype, device: str, reps: int, copy_gbs: float, *, compile_too: bool) -> str:
    """One row of the table: a case's fused kernels against eager and (``compile_too``) torch.compile."""
    name, fused, eager, inputs, nbytes = case
    t_fused = timed(fwd_bwd(fused, *inputs), device, reps)
    t_eager = timed(fwd_bwd(eager, *inputs), device, reps)
    t_compiled = timed(fwd_bwd(torch.compile(eager), *inputs), device, reps) if compile_too else float("nan")
    gbs = nbytes / t_fused / 1e9
    cells = [
        name + " fwd+bwd",
        str(dtype)[6:],
        f"{t_fused * 1e3:.3f}",
        f"{gbs:.0f}",
        f"{100 * gbs / copy_gbs:.0f}%",
        f"{t_eager * 1e3:.3f}",
        f"{t_compiled * 1e3:.3f}",
        f"{t_eager / t_fused:.2f}x",
        f"{t_compiled / t_fused:.2f}x",
    ]
    return "| " + " | ".join(cells) + " |"


def _adamw_line(device: str, scale: int, reps: int, copy_gbs: float) -> str:
    """Our fused AdamW step on a 1 GiB fp32 partition (bf16 gradient in, bf16 copy out) against torch's."""
    n = 2**28 // scale**2
    p, m, v = (torch.randn(n, device=device) for _ in range(3))
    v.abs_()
    g16 = torch.randn(n, device=device, dtype=torch.bfloat16)
    low = torch.empty(n, device=device, dtype=torch.bfloat16)
    hyper = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=10, inv_scale=1.0)
    t_ours = timed(lambda: fused_adamw_(p, g16, m, v, **hyper, lowp_out=low), device, reps)
    tp = torch.randn(n, device=device)
    tp.grad = torch.randn(n, device=device)
    torch_opt = torch.optim.AdamW([tp], lr=1e-4, fused=device == "cuda")
    torch_opt.step()
    t_torch = timed(torch_opt.step, device, reps)
    adam_bytes = n * (4 * 3 * 2 + 2 + 2)  # p, m, v read and written; bf16 grad read; bf16 copy written
    gbs = adam_bytes / t_ours / 1e9
    return (
        f"Fused AdamW over {n:,} fp32 elements (bf16 gradient unscaled, bf16 copy written): {t_ours * 1e3:.3f} ms,"
        f" {gbs:.0f} GB/s = {100 * gbs / copy_gbs:.0f}% of copy; torch AdamW(fused=True) on fp32 grads:"
        f" {t_torch * 1e3:.3f} ms ({t_torch / t_ours:.2f}x ours)."
    )


def _gpt_block_line(device: str, scale: int, reps: int) -> str:
    """One fused GPT block's forward and backward under bf16 autocast against the plain block's."""
    cfg = dict(vocab_size=64, block_size=1024 // scale, n_layer=1, n_head=16, n_embd=1024 // scale)
    plain, fused = GPT(GPTConfig(**cfg)).to(device), GPT(GPTConfig(**cfg, fused=True)).to(device)
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(8, cfg["block_size"], cfg["n_embd"], device=device, requires_grad=True)
    layer = lambda block: fwd_bwd(lambda x: block(x), x)  # noqa: E731
    with torch.autocast(device, dtype=torch.bfloat16):
        t_plain = timed(layer(plain.blocks[0]), device, reps)
        t_layer = timed(layer(fused.blocks[0]), device, reps)
    return (
        f"Fused GPT block (bf16 autocast, B=8, T={cfg['block_size']}, C={cfg['n_embd']}) fwd+bwd:"
        f" {t_layer * 1e3:.3f} ms vs eager block {t_plain * 1e3:.3f} ms ({t_plain / t_layer:.2f}x)."
    )


if __name__ == "__main__":
    main()
