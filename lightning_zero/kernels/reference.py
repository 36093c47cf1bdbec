"""Pure-torch versions of every fused kernel: the CPU fallback and the GPU tests' oracle.

They compute in fp32 (like the kernels) and return the input's dtype; their backward is torch's
autograd. Dropout draws its mask from the same counter-based Philox stream as the kernels
(``philox_uniform``), so a given (seed, offset) drops the same elements on any device.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF


def _mulhilo(a: int, b: Tensor) -> tuple[Tensor, Tensor]:
    """High and low 32-bit words of a * b for a constant a and uint32 values b in int64 (no overflow)."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    low_part = a_lo * b  # < 2^48
    high_part = a_hi * b  # < 2^48
    lo_sum = low_part + ((high_part & 0xFFFF) << 16)
    return (high_part >> 16) + (lo_sum >> 32), lo_sum & _MASK32


def philox4x32(counter: tuple[Tensor, Tensor, Tensor, Tensor], key: tuple[int, int]) -> tuple[Tensor, ...]:
    """Philox4x32-10 on uint32 words held in int64 tensors, as common.cuh's philox4x32."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


def philox_uniform(seed: int, offset: int, index: Tensor) -> Tensor:
    """Uniform floats in [0, 1) for int64 ``index``; bit for bit what common.cuh's philox_uniform4 gives:
    element i is word i % 4 of the Philox call at counter (offset // 4 + i // 4, subsequence 0)."""
    count = (index >> 2) + (offset >> 2)
    zero = torch.zeros_like(index)
    counter = (count & _MASK32, (count >> 32) & _MASK32, zero, zero)
    words = torch.stack(philox4x32(counter, (seed & _MASK32, (seed >> 32) & _MASK32)))
    word = words.gather(0, (index & 3).unsqueeze(0)).squeeze(0)
    return (word >> 8).to(torch.float32) * (1.0 / 16777216.0)


def _keep(shape: torch.Size, p: float, seed: int, offset: int, device: torch.device) -> Tensor:
    index = torch.arange(math.prod(shape), dtype=torch.int64, device=device).view(shape)
    return philox_uniform(seed, offset, index) >= p


def stream_tensor(seed: int, offset: int, device: torch.device | str = "cpu") -> Tensor:
    """The dropout stream (seed, offset) as the kernels read it: two int64s on the device. A seed of 2^63 or
    more keeps its bits (as the int64 of the same bits); the offset counts elements and must be >= 0."""
    if not 0 <= offset < 2**63:
        raise ValueError(f"the dropout offset must be in [0, 2^63), got {offset}")
    stream = torch.empty(2, dtype=torch.int64, device=device)
    stream[:1].fill_(seed - 2**64 if seed >= 2**63 else seed)  # fill kernels (an item assignment would copy
    stream[1:].fill_(offset)  # from the host and sync): capturable in a CUDA graph
    return stream


def _seed_offset(stream: Tensor | None) -> tuple[int, int]:
    return (0, 0) if stream is None else tuple(stream.tolist())


def dropout(x: Tensor, p: float, seed: int, offset: int) -> Tensor:
    """Inverted dropout of ``x`` with probability ``p``, its mask drawn from the stream (``seed``, ``offset``)."""
    if p == 0.0:
        return x
    return torch.where(_keep(x.shape, p, seed, offset, x.device), x / (1.0 - p), torch.zeros_like(x))


def bias_gelu(x: Tensor, bias: Tensor, approximate: str = "tanh") -> Tensor:
    """GELU(x + bias) in fp32, in ``x``'s dtype; ``approximate`` as torch's ("tanh" or "none")."""
    return F.gelu(x.float() + bias.float(), approximate=approximate).to(x.dtype)


# --- forward and backward apart, as the kernels split them (launchers.py): fp32 inside, their dtypes out ---
def layer_norm_fwd(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm over ``x``'s last dimension, in ``x``'s dtype, and each row's mean and rstd in fp32."""
    rows = x.float().reshape(-1, x.shape[-1])
    mean = rows.mean(-1)
    rstd = torch.rsqrt((rows - mean[:, None]).square().mean(-1) + eps)  # two passes, as the kernels
    y = (rows - mean[:, None]) * rstd[:, None] * weight.float() + bias.float()
    return y.view(x.shape).to(x.dtype), mean, rstd


def layer_norm_bwd(
    dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor, bias_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm's (dx, dweight, dbias) from ``layer_norm_fwd``'s ``mean`` and ``rstd``, in the dtypes of ``x``,
    ``weight`` and ``bias_dtype``."""
    dx, dy_rows, xhat = _layer_norm_grads(dy, x, weight, mean, rstd)
    return dx.view(x.shape).to(x.dtype), (dy_rows * xhat).sum(0).to(weight.dtype), dy_rows.sum(0).to(bias_dtype)


def _layer_norm_grads(dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor) -> tuple[Tensor, ...]:
    """LayerNorm's input gradient in fp32 as [rows, cols], with dy as [rows, cols] and x-hat (for the
    parameters' gradients)."""
    cols = x.shape[-1]
    dy_rows = dy.float().reshape(-1, cols)
    xhat = (x.float().reshape(-1, cols) - mean[:, None]) * rstd[:, None]
    g = dy_rows * weight.float()
    dx = rstd[:, None] * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx, dy_rows, xhat


def residual_layer_norm_fwd(
    x: Tensor, bias: Tensor, residual: Tensor, weight: Tensor, ln_bias: Tensor, p: float, eps: float, stream
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """hidden = residual + dropout(x + bias), and LayerNorm(hidden) with its mean and rstd."""
    hidden = bias_dropout_residual_fwd(x, bias, residual, p, stream)
    return (hidden, *layer_norm_fwd(hidden, weight, ln_bias, eps))


def residual_layer_norm_bwd(
    dnormed: Tensor,
    dhidden: Tensor,
    hidden: Tensor,
    weight: Tensor,
    mean: Tensor,
    rstd: Tensor,
    p: float,
    stream: Tensor | None,
    bias_dtype: torch.dtype,
    ln_bias_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dbias, dresidual, dweight, dln_bias): hidden's whole gradient (LayerNorm's plus the residual
    stream's) in fp32, rounded once for dresidual and once, through dropout, for dx."""
    dh, dn, xhat = _layer_norm_grads(dnormed, hidden, weight, mean, rstd)
    dh = dh + dhidden.float().reshape(dh.shape)
    dx = dropout_bwd(dh, p, stream) if p > 0 else dh.clone()  # (outputs of a custom op never alias)
    to = hidden.dtype
    return (
        dx.view(hidden.shape).to(to),
        dx.sum(0).to(bias_dtype),
        dh.view(hidden.shape).to(to),
        (dn * xhat).sum(0).to(weight.dtype),
        dn.sum(0).to(ln_bias_dtype),
    )


def gelu_derivative(u: Tensor, tanh: bool) -> Tensor:
    """d GELU(u) / du, of the tanh approximation with ``tanh``, else of the exact (erf) GELU."""
    if tanh:  # in torch's own order of operations
        k, u2 = math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5, u * u
        t = torch.tanh(k * (u + 0.044715 * (u2 * u)))
        return 0.5 * (1.0 + t) + (0.5 * u) * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * u2)
    return 0.5 * (1.0 + torch.erf(u / math.sqrt(2.0))) + u * torch.exp(-0.5 * u * u) / math.sqrt(2.0 * math.pi)


def bias_gelu_bwd(dy: Tensor, x: Tensor, bias: Tensor, tanh: bool) -> tuple[Tensor, Tensor]:
    """``bias_gelu``'s (dx, dbias): dx in ``x``'s dtype, dbias its column sum in ``bias``' dtype."""
    dx = (dy.float() * gelu_derivative(x.float() + bias.float(), tanh)).to(x.dtype)
    return dx, column_sum(dx, bias.dtype)


def column_sum(data: Tensor, dtype: torch.dtype) -> Tensor:
    """The sum of ``data`` over every dimension but the last, in fp32, as ``dtype``."""
    return data.float().reshape(-1, data.shape[-1]).sum(0).to(dtype)


def softmax_dropout(
    scores: Tensor,
    scale: float,
    *,
    causal: bool = False,
    mask: Tensor | None = None,
    p: float = 0.0,
    seed: int = 0,
    offset: int = 0,
) -> Tensor:
    """softmax(scores * scale + mask, hiding keys after the query when causal), then dropout with the stream
    (seed, offset).

    ``scores`` is (batch, heads, q_len, k_len); ``mask`` is additive and broadcasts to it (ops.softmax_dropout
    turns a bool mask into one). A row with every key hidden gives zeros.
    """
    return softmax_dropout_fwd(scores, mask, scale, causal, p, stream_tensor(seed, offset))[0]


def softmax_dropout_fwd(
    scores: Tensor, mask: Tensor | None, scale: float, causal: bool, p: float, stream: Tensor | None
) -> tuple[Tensor, Tensor]:
    """As launchers.softmax_dropout_fwd: the output, and the probabilities when dropout is on (else empty)."""
    x = scores.float() * scale
    if mask is not None:
        x = x + mask.float()
    if causal:
        q_len, k_len = scores.shape[-2:]
        hidden = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).triu(k_len - q_len + 1)
        x = x.masked_fill(hidden, float("-inf"))
    all_hidden = torch.isneginf(x).all(dim=-1, keepdim=True)
    probs = torch.softmax(x.masked_fill(all_hidden, 0.0), dim=-1)  # no NaN, in values or in gradients
    probs = probs.masked_fill(all_hidden, 0.0)
    out = dropout(probs, p, *_seed_offset(stream)).to(scores.dtype)
    return out, (probs.to(scores.dtype) if p > 0 else scores.new_empty(0))


def softmax_dropout_bwd(dout: Tensor, probs: Tensor, scale: float, p: float, stream: Tensor | None) -> Tensor:
    """The scores' gradient through ``softmax_dropout_fwd`` from its ``probs`` (the dropout's mask from ``stream``)."""
    d = dropout_bwd(dout.float(), p, stream)
    pf = probs.float()
    return (scale * pf * (d - (d * pf).sum(-1, keepdim=True))).to(probs.dtype)


def dropout_bwd(dy: Tensor, p: float, stream: Tensor | None) -> Tensor:
    """The gradient through ``dropout(., p, *stream)``: the same elements kept and scaled."""
    if p == 0.0:
        return dy
    keep = _keep(dy.shape, p, *_seed_offset(stream), dy.device)
    return torch.where(keep, dy.float() * (1.0 / (1.0 - p)), 0.0).to(dy.dtype)


def bias_dropout_residual_fwd(x: Tensor, bias: Tensor, residual: Tensor, p: float, stream: Tensor | None) -> Tensor:
    """residual + dropout(x + bias) in fp32, in the promoted dtype of ``x`` and ``residual``."""
    dtype = torch.promote_types(x.dtype, residual.dtype)
    return (residual.float() + dropout(x.float() + bias.float(), p, *_seed_offset(stream))).to(dtype)


@torch.no_grad()
def adamw_(
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
    """torch.optim.AdamW's update on fp32 ``param`` with moments in place; skipped while ``found_inf`` is set."""
    if found_inf is not None and bool(found_inf.item()):
        return
    g = grad.float() * (inv_scale if multiplier is None else multiplier * inv_scale)  # as the kernel: one factor
    param.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1.0 - beta2**step)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / (1.0 - beta1**step))
    if lowp_out is not None:
        lowp_out.copy_(param)


def check_finite_(grad: Tensor, found_inf: Tensor) -> None:
    """Sets ``found_inf`` to 1 if ``grad`` holds an inf or nan (device-side, like the kernel)."""
    found_inf.copy_(torch.maximum(found_inf, (~torch.isfinite(grad)).any().to(found_inf.dtype)))


# --- block-wise int8 quantization (cuda_kernels/quantize.cu; sharding/quantize.py) ------------------------
QUANTIZE_LEVELS = 127  # symmetric int8: -127..127 (-128 unused, so that negating a value is exact)


def quantize_blocks(x: Tensor, block: int, levels: int = QUANTIZE_LEVELS) -> tuple[Tensor, Tensor]:
    """int8 values in [-levels, levels] and fp32 scales (absmax / levels, infinite where a value is not
    finite) of ``x``'s rows cut into blocks of ``block`` elements."""
    n, lead = x.shape[-1], x.shape[:-1]
    blocks = -(-n // block)
    padded = torch.zeros(*lead, blocks * block, dtype=torch.float32, device=x.device)
    padded[..., :n] = x
    rows = padded.view(*lead, blocks, block)
    magnitudes = rows.abs()
    scales = magnitudes.masked_fill(magnitudes.isnan(), float("inf")).amax(dim=-1) / levels
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block stays zero
    values = torch.round(rows / safe.unsqueeze(-1))
    values = values.masked_fill_(values.isnan(), 0.0).clamp_(-levels, levels)
    return values.to(torch.int8).view(*lead, blocks * block)[..., :n].contiguous(), scales


def dequantize_blocks(out: Tensor, values: Tensor, scales: Tensor, block: int) -> None:
    """``out`` = each value times its block's scale, computed in fp32, stored in ``out``'s dtype."""
    n, blocks = values.shape[-1], scales.shape[-1]
    lead = values.shape[:-1]
    padded = torch.zeros(*lead, blocks * block, dtype=torch.float32, device=values.device)
    padded[..., :n] = values
    whole = padded.view(*lead, blocks, block) * scales.unsqueeze(-1)
    out.copy_(whole.view(*lead, blocks * block)[..., :n])
