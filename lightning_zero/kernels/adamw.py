"""Fused AdamW: one kernel pass per flat fp32 buffer, and a torch optimizer built on it.

``fused_adamw_`` updates an fp32 parameter (a ZeRO master partition, or any fp32 tensor) and its two
moments from a gradient of any float dtype, unscaled by ``inv_scale``; with ``found_inf`` (a device
int32 flag, set by ``check_finite_``) it does nothing when the flag is set, without a host sync; with
``lowp_out`` it also writes the updated weights in fp16/bf16 (the copy ZeRO all-gathers).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
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
    head = _head(n, *pointers)
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


def _head(n: int, *pointers: int) -> int:
    """ZeRO's piece views start anywhere: when the fp32 buffers are equally misaligned, the kernel peels the
    first ``head`` elements up to a 16-byte boundary and loads four at a time after it (-1: one at a time)."""
    misaligned = {p % 16 for p in pointers}
    equal = len(misaligned) == 1 and all(p % 4 == 0 for p in pointers)
    return min(n, (16 - misaligned.pop()) % 16 // 4) if equal else -1


@dataclass
class AdamWRun:
    """One tensor's AdamW step for the fused kernels (CUDA: ``multi_adamw_``; host: ``kernels.host``): ``param``
    and the moments (fp32) in place, from ``grad`` multiplied by ``grad_mul`` (and by a launch's common scale);
    ``lowp_out`` (fp16/bf16, optional) receives the updated values. ``step`` is this step's count (from 1): a
    number, or an fp32 tensor on the parameters' device that the CUDA kernel reads (FusedAdamW under a
    GradScaler: counts that a device overflow flag holds back without a host sync; the reference and the
    host kernel read it on the host)."""

    param: Tensor
    grad: Tensor
    exp_avg: Tensor
    exp_avg_sq: Tensor
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int | Tensor
    grad_mul: float = 1.0
    lowp_out: Tensor | None = None


# AdamWTask in cuda_kernels/adamw.cu, field for field
TASK = np.dtype(
    [(name, "<i8") for name in ("param", "grad", "exp_avg", "exp_avg_sq", "lowp", "step", "n", "head")]
    + [("beta1_exact", "<f8"), ("beta2_exact", "<f8")]
    + [(name, "<f4") for name in ("lr", "beta1", "beta2", "eps", "weight_decay", "bias1", "bias2_sqrt", "grad_mul")]
)
SPAN = 2**18  # elements a block steps in a multi-tensor launch


@torch.no_grad()
def multi_adamw_(
    runs: list[AdamWRun],
    *,
    inv_scale: float = 1.0,
    multiplier: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """``fused_adamw_`` on every run: on CUDA one launch per (device, gradient dtype, 16-bit output dtype),
    its tasks and their spans of at most SPAN elements sent in one pinned asynchronous copy (no host sync),
    each block stepping one span; elsewhere the reference, run by run."""
    plan_multi_adamw(runs, inv_scale=inv_scale, multiplier=multiplier, found_inf=found_inf)()


def plan_multi_adamw(
    runs: list[AdamWRun],
    *,
    inv_scale: float = 1.0,
    multiplier: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> Callable[[], None]:
    """``multi_adamw_`` in two halves: every input is checked and every task table built now (an error leaves
    everything as it was), the steps run when the returned function is called."""
    scale = dict(multiplier=multiplier, found_inf=found_inf)
    groups: dict[tuple, list[AdamWRun]] = {}
    on_reference = []
    for run in runs:
        if use_kernels(run.param) and run.param.numel() > 0:
            key = (run.param.device, run.grad.dtype, None if run.lowp_out is None else run.lowp_out.dtype)
            groups.setdefault(key, []).append(run)
        else:
            _check_sizes(run)
            on_reference.append(run)
    if any(device.type == "cuda" for device, *_ in groups) and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the multi-tensor AdamW step cannot be captured in a CUDA graph: its task table (addresses, learning"
            " rates, step counts) is built on the host at every step"
        )
    launches = []
    for (device, grad_dtype, lowp_dtype), group in groups.items():
        tasks, spans = _task_table(group)
        like = group[0].param
        flag = 0 if found_inf is None else tensor(found_inf, "found_inf", dtypes=(torch.int32,), like=like)
        scalar = 0 if multiplier is None else tensor(multiplier, "multiplier", dtypes=(torch.float32,), like=like)
        kernel = f"adamw_multi_{SUFFIX[grad_dtype]}_{LOWP[lowp_dtype]}"
        launches.append((device, kernel, tasks, spans, flag, scalar))

    def step() -> None:
        for run in on_reference:
            fused_adamw_(
                *_tensors(run), **_hyper(run), lowp_out=run.lowp_out, **scale, inv_scale=inv_scale * run.grad_mul
            )
        for device, kernel, tasks, spans, flag, scalar in launches:
            table = _to_device(np.concatenate([tasks.view(np.uint8), spans.view(np.uint8).ravel()]), device)
            args = (table.data_ptr(), table.data_ptr() + tasks.nbytes, f32(inv_scale), scalar, flag)
            launch("adamw.cu", kernel, len(spans), 256, args, device=device)

    return step


def _tensors(run: AdamWRun) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return run.param, run.grad, run.exp_avg, run.exp_avg_sq


def _hyper(run: AdamWRun) -> dict:
    """The run's hyper-parameters for ``fused_adamw_`` (a device step count read: the reference path only)."""
    keys = ("lr", "beta1", "beta2", "eps", "weight_decay")
    return {key: getattr(run, key) for key in keys} | {"step": int(run.step)}


def _task_table(runs: list[AdamWRun]) -> tuple[np.ndarray, np.ndarray]:
    """The runs as AdamWTasks (checked as ``fused_adamw_`` checks them) and their spans (task, lo, hi): cut
    every SPAN elements from the task's 16-byte boundary, so a span after it starts on a group of four."""
    tasks, spans = np.zeros(len(runs), dtype=TASK), []
    for index, run in enumerate(runs):
        n, like, f32_only = run.param.numel(), run.param, (torch.float32,)
        _check_sizes(run)
        param = tensor(run.param, "param", dtypes=f32_only)
        moments = [
            tensor(t, name, dtypes=f32_only, like=like)
            for t, name in ((run.exp_avg, "exp_avg"), (run.exp_avg_sq, "exp_avg_sq"))
        ]
        grad = tensor(run.grad, "grad", dtypes=tuple(SUFFIX), like=like)
        lowp = 0 if run.lowp_out is None else tensor(run.lowp_out, "lowp_out", dtypes=tuple(LOWP)[1:], like=like)
        head = _head(n, param, *moments)
        if torch.is_tensor(run.step):  # the kernel computes the bias corrections from the device count
            step, bias = tensor(run.step, "step", dtypes=f32_only, like=like), (1.0, 1.0)
        else:
            step, bias = 0, (1.0 - run.beta1**run.step, math.sqrt(1.0 - run.beta2**run.step))
        tasks[index] = (
            param,
            grad,
            *moments,
            lowp,
            step,
            n,
            head,
            run.beta1,
            run.beta2,
            run.lr,
            run.beta1,
            run.beta2,
            run.eps,
            run.weight_decay,
            *bias,
            run.grad_mul,
        )
        bounds = [0, *range(max(head, 0) + SPAN, n, SPAN), n]
        spans += [(index, lo, hi) for lo, hi in zip(bounds, bounds[1:])]
    return tasks, np.asarray(spans, dtype="<i8")


def _check_sizes(run: AdamWRun) -> None:
    n = run.param.numel()
    for name, t in (
        ("grad", run.grad),
        ("exp_avg", run.exp_avg),
        ("exp_avg_sq", run.exp_avg_sq),
        ("lowp_out", run.lowp_out),
    ):
        if t is not None and t.numel() != n:
            raise ValueError(f"{name} has {t.numel()} elements, param has {n}")


def _to_device(blob: np.ndarray, device: torch.device) -> Tensor:
    """``blob``'s bytes on ``device``: through pinned memory and an asynchronous copy on CUDA (the caching
    host allocator keeps the pinned block until the copy is done), a copy elsewhere."""
    if device.type != "cuda":
        return torch.from_numpy(blob.copy())
    pinned = torch.empty(blob.nbytes, dtype=torch.uint8, pin_memory=True)
    pinned.numpy()[:] = blob
    return pinned.to(device, non_blocking=True)


class FusedAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's arithmetic (decoupled weight decay, no amsgrad) with one multi-tensor kernel launch
    per device for all parameters on CUDA, the pure-torch reference elsewhere. Parameters must be fp32 (ZeRO's
    masters are); the state has AdamW's keys, so it also works as the optimizer the ZeRO strategies wrap.

    Under torch's ``GradScaler`` (Lightning's ``precision="16-mixed"`` outside ZeRO) it takes the scaler's
    ``grad_scale`` and ``found_inf`` device tensors, as torch's fused optimizers do: the kernel unscales the
    gradients and skips on the overflow flag, and the step counts live on the parameters' device (fp32),
    where they advance by ``1 - found_inf``: after the first step (which moves host counts over), a step
    never waits for the GPU. Lightning then refuses gradient clipping, as for torch's fused optimizers,
    since the gradients are never unscaled outside the step: ``unscale_in_step=False`` keeps torch's
    GradScaler path instead (it unscales first, and reads the overflow flag on the host).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        unscale_in_step: bool = True,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(
                f"invalid FusedAdamW hyper-parameters: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}"
            )
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self._step_supports_amp_scaling = unscale_in_step  # GradScaler.step then sets grad_scale and found_inf

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)  # GradScaler's
        by_device: dict[torch.device, tuple[list[AdamWRun], list[Tensor]]] = {}
        host_counts = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dtype != torch.float32:
                    raise ValueError(f"FusedAdamW updates fp32 parameters, got one of dtype {p.dtype}")
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                count = _step_count(state.get("step", 0.0), p.device, on_device=found_inf is not None)
                state["step"] = count
                runs, device_counts = by_device.setdefault(p.device, ([], []))
                on_device = count.device.type != "cpu" or found_inf is not None
                (device_counts if on_device else host_counts).append(count)
                hyper = dict(lr=group["lr"], eps=group["eps"], weight_decay=group["weight_decay"])
                step = count if on_device else int(count) + 1  # a host count: the count after this step
                moments = dict(exp_avg=state["exp_avg"], exp_avg_sq=state["exp_avg_sq"])
                runs.append(AdamWRun(p, p.grad.contiguous(), **moments, beta1=beta1, beta2=beta2, step=step, **hyper))
        plans, keeps = [], []
        for device, (runs, device_counts) in by_device.items():  # the scaler's tensors live on one device
            flag = None if found_inf is None else (found_inf > 0).to(device, torch.int32, non_blocking=True)
            scale = None if grad_scale is None else grad_scale.to(device, torch.float32, non_blocking=True)
            multiplier = None if scale is None else scale.reciprocal()
            plans.append(plan_multi_adamw(runs, multiplier=multiplier, found_inf=flag))  # (checks all first)
            keeps.append((device_counts, 1.0 if flag is None else (1 - flag).float()))
        if host_counts:
            torch._foreach_add_(host_counts, 1.0)
        for device_counts, keep in keeps:  # read by the kernel as this step's count
            if device_counts:
                torch._foreach_add_(device_counts, keep)
        for plan in plans:
            plan()  # one launch per device on CUDA
        return loss


def _step_count(count: Any, device: torch.device, on_device: bool) -> Tensor:
    """A parameter's step count as FusedAdamW keeps it: an fp32 tensor, on the host unless a GradScaler steps
    (``on_device``) or it was already on a device, then on the parameter's (a checkpoint may bring a number,
    fp64, or another rank's device). A host count moves to the device once, from pageable memory."""
    count = count if torch.is_tensor(count) else torch.tensor(float(count))
    target = device if on_device or count.device.type != "cpu" else count.device
    if count.device != target or count.dtype != torch.float32:
        count = count.to(target, torch.float32, non_blocking=True)
    return count
