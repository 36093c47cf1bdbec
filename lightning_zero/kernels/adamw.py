"""Fused AdamW: one kernel pass per flat fp32 buffer, and a torch optimizer built on it.

``fused_adamw_`` updates an fp32 parameter (a ZeRO master partition, or any fp32 tensor) and its two
moments from a gradient of any float dtype, unscaled by ``inv_scale``; with ``found_inf`` (a device
int32 flag, set by ``check_finite_``) it does nothing when the flag is set, without a host sync; with
``lowp_out`` it also writes the updated weights in fp16/bf16 (the copy ZeRO all-gathers).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from lightning_zero.kernels import reference
from lightning_zero.kernels.loader import SUFFIX, f32, grid_for, i64, launch, tensor, use_kernels

LOWP = {None: "none", torch.float16: "f16", torch.bfloat16: "bf16"}


def check_finite_(grad: Tensor, found_inf: Tensor) -> None:
    """Sets the int32 device flag ``found_inf`` to 1 if ``grad`` holds an inf or nan."""
    if not use_kernels(grad):
        return reference.check_finite_(grad, found_inf)
    args = (
        tensor(grad, "grad", dtypes=tuple(SUFFIX)),
        i64(grad.numel()),
        tensor(found_inf, "found_inf", dtypes=(torch.int32,), like=grad),
    )
    launch("adamw.cu", f"check_finite_{SUFFIX[grad.dtype]}", grid_for(grad.numel()), 256, args, device=grad.device)


@torch.no_grad()
def fused_adamw_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    inv_scale: float = 1.0,
    multiplier: Tensor | None = None,
    found_inf: Tensor | None = None,
    lowp_out: Tensor | None = None,
) -> None:
    """One AdamW step on ``param`` (fp32) in place; ``step`` counts from 1 (bias corrections). The gradient
    is multiplied by ``inv_scale`` and by the fp32 device scalar ``multiplier`` (read on the device)."""
    if not use_kernels(param):
        return reference.adamw_(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            step=step,
            inv_scale=inv_scale,
            multiplier=multiplier,
            found_inf=found_inf,
            lowp_out=lowp_out,
        )
    n = param.numel()
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("lowp_out", lowp_out)):
        if t is not None and t.numel() != n:
            raise ValueError(f"{name} has {t.numel()} elements, param has {n}")
    f32_only = (torch.float32,)
    pointers = [
        tensor(param, "param", dtypes=f32_only),
        tensor(exp_avg, "exp_avg", dtypes=f32_only, like=param),
        tensor(exp_avg_sq, "exp_avg_sq", dtypes=f32_only, like=param),
    ]
    # ZeRO's piece views start anywhere: when the three fp32 buffers are equally misaligned, the kernel peels
    # the first elements up to a 16-byte boundary and loads four at a time after it (head < 0: one at a time)
    misaligned = {p % 16 for p in pointers}
    equal = len(misaligned) == 1 and all(p % 4 == 0 for p in pointers)
    head = min(n, (16 - misaligned.pop()) % 16 // 4) if equal else -1
    lowp = 0 if lowp_out is None else tensor(lowp_out, "lowp_out", dtypes=(torch.float16, torch.bfloat16), like=param)
    flag = 0 if found_inf is None else tensor(found_inf, "found_inf", dtypes=(torch.int32,), like=param)
    scalar = 0 if multiplier is None else tensor(multiplier, "multiplier", dtypes=(torch.float32,), like=param)
    args = (
        pointers[0],
        tensor(grad, "grad", dtypes=tuple(SUFFIX), like=param),
        pointers[1],
        pointers[2],
        lowp,
        i64(n),
        f32(lr),
        f32(beta1),
        f32(beta2),
        f32(eps),
        f32(weight_decay),
        f32(1.0 - beta1**step),
        f32(math.sqrt(1.0 - beta2**step)),
        f32(inv_scale),
        scalar,
        flag,
        i64(head),
    )
    kernel = f"adamw_{SUFFIX[grad.dtype]}_{LOWP[None if lowp_out is None else lowp_out.dtype]}"
    launch("adamw.cu", kernel, grid_for(n, 1 if head < 0 else 4), 256, args, device=param.device)


class FusedAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's arithmetic (decoupled weight decay, no amsgrad) with one fused kernel per
    parameter on CUDA, the pure-torch reference elsewhere. Parameters must be fp32 (ZeRO's masters
    are); the state has AdamW's keys, so it also works as the optimizer the ZeRO strategies wrap."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(
                f"invalid FusedAdamW hyper-parameters: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}"
            )
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dtype != torch.float32:
                    raise ValueError(f"FusedAdamW updates fp32 parameters, got one of dtype {p.dtype}")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] += 1
                fused_adamw_(
                    p,
                    p.grad.contiguous(),
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    step=int(state["step"]),
                )
        return loss
