"""The fused ops, as torch custom ops: CUDA kernels on CUDA tensors (CuPy present), pure-torch references
elsewhere, one op for each forward and each backward.

Each op takes activations of any leading shape in fp32, fp16 or bf16; parameters (weight, bias) may be
in any float dtype: the kernels read them as fp32 and their gradients come back in their own dtype.
Split in three, as apex and DeepSpeed's op builders split theirs: kernel source (``cuda_kernels/``) / host
launch (``launchers.py``) / the ops and their autograd (here).

[Note: custom ops]
Every forward and backward is a ``torch.library.custom_op`` (namespace ``lightning_zero``) with a fake
implementation (shapes and dtypes only) and its autograd registered, so ``torch.compile`` traces through
them without a graph break and AOT autograd sees the backward as one op too; ``torch.library.opcheck``
checks the registrations in the CPU test suite. Inside, ``use_kernels`` picks the kernel or the reference,
so the same op runs on any device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_zero.kernels import launchers, reference
from lightning_zero.kernels.loader import SUFFIX, dropout_stream, use_kernels

FLOATS = tuple(SUFFIX)
_LIB = "lightning_zero::"


def _pick(x: Tensor, name: str):
    """The kernel launcher ``name`` for CUDA tensors (kernels available), else (or when empty: no grid to
    launch) the reference of that name."""
    return getattr(launchers if _kernels(x) else reference, name)


def _kernels(x: Tensor) -> bool:
    return use_kernels(x) and x.numel() > 0


# --- layer norm -------------------------------------------------------------------------------------
@torch.library.custom_op(_LIB + "layer_norm_fwd", mutates_args=())
def _layer_norm_fwd(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return _pick(x, "layer_norm_fwd")(x, weight, bias, eps)


@_layer_norm_fwd.register_fake
def _(x, weight, bias, eps):
    rows = x.numel() // x.shape[-1]
    return torch.empty_like(x), x.new_empty(rows, dtype=torch.float32), x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op(_LIB + "layer_norm_bwd", mutates_args=())
def _layer_norm_bwd(
    dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor, bias_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    return _pick(x, "layer_norm_bwd")(dy, x, weight, mean, rstd, bias_dtype)


@_layer_norm_bwd.register_fake
def _(dy, x, weight, mean, rstd, bias_dtype):
    return torch.empty_like(x), torch.empty_like(weight), weight.new_empty(weight.shape, dtype=bias_dtype)


def _layer_norm_setup(ctx, inputs, output) -> None:
    x, weight, bias, _ = inputs
    ctx.save_for_backward(x, weight, output[1], output[2])
    ctx.bias_dtype = bias.dtype


def _layer_norm_backward(ctx, dy, _mean, _rstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = _layer_norm_bwd(dy, x, weight, mean, rstd, ctx.bias_dtype)
    return dx, dw, db, None


_layer_norm_fwd.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup)


# --- bias + GeLU ------------------------------------------------------------------------------------
@torch.library.custom_op(_LIB + "bias_gelu_fwd", mutates_args=())
def _bias_gelu_fwd(x: Tensor, bias: Tensor, tanh: bool) -> Tensor:
    if _kernels(x):
        return launchers.bias_gelu_fwd(x, bias, tanh)
    return reference.bias_gelu(x, bias, "tanh" if tanh else "none")


@_bias_gelu_fwd.register_fake
def _(x, bias, tanh):
    return torch.empty_like(x)


@torch.library.custom_op(_LIB + "bias_gelu_bwd", mutates_args=())
def _bias_gelu_bwd(dy: Tensor, x: Tensor, bias: Tensor, tanh: bool) -> tuple[Tensor, Tensor]:
    return _pick(x, "bias_gelu_bwd")(dy, x, bias, tanh)


@_bias_gelu_bwd.register_fake
def _(dy, x, bias, tanh):
    return torch.empty_like(x), torch.empty_like(bias)


def _bias_gelu_setup(ctx, inputs, output) -> None:
    x, bias, tanh = inputs
    ctx.save_for_backward(x, bias)
    ctx.tanh = tanh


def _bias_gelu_backward(ctx, dy):
    x, bias = ctx.saved_tensors
    dx, db = _bias_gelu_bwd(dy, x, bias, ctx.tanh)
    return dx, db, None


_bias_gelu_fwd.register_autograd(_bias_gelu_backward, setup_context=_bias_gelu_setup)


# --- softmax + dropout --------------------------------------------------------------------------------
@torch.library.custom_op(_LIB + "softmax_dropout_fwd", mutates_args=())
def _softmax_dropout_fwd(
    scores: Tensor, mask: Tensor | None, scale: float, causal: bool, p: float, stream: Tensor | None
) -> tuple[Tensor, Tensor]:
    return _pick(scores, "softmax_dropout_fwd")(scores, mask, scale, causal, p, stream)


@_softmax_dropout_fwd.register_fake
def _(scores, mask, scale, causal, p, stream):
    return torch.empty_like(scores), (torch.empty_like(scores) if p > 0 else scores.new_empty(0))


@torch.library.custom_op(_LIB + "softmax_dropout_bwd", mutates_args=())
def _softmax_dropout_bwd(dout: Tensor, probs: Tensor, scale: float, p: float, stream: Tensor | None) -> Tensor:
    return _pick(probs, "softmax_dropout_bwd")(dout, probs, scale, p, stream)


@_softmax_dropout_bwd.register_fake
def _(dout, probs, scale, p, stream):
    return torch.empty_like(probs)


def _softmax_dropout_setup(ctx, inputs, output) -> None:
    _, _, scale, _, p, stream = inputs
    out, probs = output
    ctx.save_for_backward(probs if p > 0 else out, stream)  # without dropout the output is the probabilities
    ctx.params = (scale, p)


def _softmax_dropout_backward(ctx, dout, _probs):
    probs, stream = ctx.saved_tensors
    return _softmax_dropout_bwd(dout, probs, *ctx.params, stream), None, None, None, None, None


_softmax_dropout_fwd.register_autograd(_softmax_dropout_backward, setup_context=_softmax_dropout_setup)


# --- bias + dropout + residual ---------------------------------------------------------------------------
@torch.library.custom_op(_LIB + "bias_dropout_residual_fwd", mutates_args=())
def _bias_dropout_residual_fwd(x: Tensor, bias: Tensor, residual: Tensor, p: float, stream: Tensor | None) -> Tensor:
    return _pick(x, "bias_dropout_residual_fwd")(x, bias, residual, p, stream)


@_bias_dropout_residual_fwd.register_fake
def _(x, bias, residual, p, stream):
    return torch.empty_like(x)


@torch.library.custom_op(_LIB + "dropout_bwd", mutates_args=())
def _dropout_bwd(dy: Tensor, p: float, stream: Tensor) -> Tensor:
    return _pick(dy, "dropout_bwd")(dy, p, stream)  # (called with p > 0 only: at 0 it would alias dy)


@_dropout_bwd.register_fake
def _(dy, p, stream):
    return torch.empty_like(dy)


@torch.library.custom_op(_LIB + "column_sum", mutates_args=())
def _column_sum(data: Tensor, dtype: torch.dtype) -> Tensor:
    return _pick(data, "column_sum")(data, dtype)


@_column_sum.register_fake
def _(data, dtype):
    return data.new_empty(data.shape[-1], dtype=dtype)


def _bias_dropout_residual_setup(ctx, inputs, output) -> None:
    _, bias, _, p, stream = inputs
    ctx.save_for_backward(stream)
    ctx.p, ctx.bias_dtype = p, bias.dtype


def _bias_dropout_residual_backward(ctx, dy):
    (stream,) = ctx.saved_tensors
    dx = _dropout_bwd(dy, ctx.p, stream) if ctx.p > 0 else dy
    return dx, _column_sum(dx, ctx.bias_dtype), dy, None, None


_bias_dropout_residual_fwd.register_autograd(
    _bias_dropout_residual_backward, setup_context=_bias_dropout_residual_setup
)


# --- bias + dropout + residual + LayerNorm (a pre-LN block's seam) ---------------------------------------
@torch.library.custom_op(_LIB + "residual_layer_norm_fwd", mutates_args=())
def _residual_layer_norm_fwd(
    x: Tensor,
    bias: Tensor,
    residual: Tensor,
    weight: Tensor,
    ln_bias: Tensor,
    p: float,
    eps: float,
    stream: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _pick(x, "residual_layer_norm_fwd")(x, bias, residual, weight, ln_bias, p, eps, stream)


@_residual_layer_norm_fwd.register_fake
def _(x, bias, residual, weight, ln_bias, p, eps, stream):
    rows = x.numel() // x.shape[-1]
    stats = [x.new_empty(rows, dtype=torch.float32) for _ in range(2)]
    return torch.empty_like(x), torch.empty_like(x), *stats


@torch.library.custom_op(_LIB + "residual_layer_norm_bwd", mutates_args=())
def _residual_layer_norm_bwd(
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
    pick = _pick(hidden, "residual_layer_norm_bwd")
    return pick(dnormed, dhidden, hidden, weight, mean, rstd, p, stream, bias_dtype, ln_bias_dtype)


@_residual_layer_norm_bwd.register_fake
def _(dnormed, dhidden, hidden, weight, mean, rstd, p, stream, bias_dtype, ln_bias_dtype):
    cols = hidden.shape[-1]
    grads = (torch.empty_like(hidden), hidden.new_empty(cols, dtype=bias_dtype), torch.empty_like(hidden))
    return (*grads, torch.empty_like(weight), weight.new_empty(cols, dtype=ln_bias_dtype))


def _residual_layer_norm_setup(ctx, inputs, output) -> None:
    _, bias, _, weight, ln_bias, p, _, stream = inputs
    hidden, _, mean, rstd = output
    ctx.save_for_backward(hidden, weight, mean, rstd, stream)
    ctx.params = (p, bias.dtype, ln_bias.dtype)


def _residual_layer_norm_backward(ctx, dhidden, dnormed, _mean, _rstd):
    hidden, weight, mean, rstd, stream = ctx.saved_tensors
    p, bias_dtype, ln_bias_dtype = ctx.params
    grads = _residual_layer_norm_bwd(dnormed, dhidden, hidden, weight, mean, rstd, p, stream, bias_dtype, ln_bias_dtype)
    dx, dbias, dresidual, dweight, dln_bias = grads
    return dx, dbias, dresidual, dweight, dln_bias, None, None, None


_residual_layer_norm_fwd.register_autograd(_residual_layer_norm_backward, setup_context=_residual_layer_norm_setup)


def _check_input(x: Tensor, name: str = "x") -> None:
    if x.dtype not in FLOATS or x.dim() == 0:
        raise ValueError(f"{name} must be a float32, float16 or bfloat16 tensor of at least 1 dimension, got {x.dtype}")


def _check_like(name: str, t: Tensor, x: Tensor, shape: tuple[int, ...]) -> None:
    """``t`` (a parameter or a second input) has ``shape``, a float dtype and ``x``'s device."""
    shape = tuple(shape)
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} (from x's shape {tuple(x.shape)}), got {tuple(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but x is on {x.device}")


def _additive_mask(mask: Tensor, scores: Tensor) -> Tensor:
    """An fp32 additive mask broadcastable to the scores: a bool mask keeps True (as in
    ``scaled_dot_product_attention``) and hides False."""
    if mask.device != scores.device:
        raise ValueError(f"mask is on {mask.device} but scores are on {scores.device}")
    try:
        torch.broadcast_shapes(mask.shape, scores.shape)
    except RuntimeError:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to the scores' {tuple(scores.shape)}"
            " (batch, heads, q_len, k_len)"
        ) from None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    if not mask.is_floating_point():
        raise ValueError(f"mask must be bool (True = attend) or floating-point (added to the scores), got {mask.dtype}")
    return mask.float()


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dimension."""
    _check_input(x)
    _check_like("weight", weight, x, x.shape[-1:])
    _check_like("bias", bias, x, x.shape[-1:])
    return _layer_norm_fwd(x, weight, bias, eps)[0]


def bias_gelu(x: Tensor, bias: Tensor, approximate: str = "tanh") -> Tensor:
    """gelu(x + bias); ``approximate`` is "tanh" (GPT-2's) or "none" (exact erf)."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    _check_input(x)
    _check_like("bias", bias, x, x.shape[-1:])
    return _bias_gelu_fwd(x, bias, approximate == "tanh")


def softmax_dropout(
    scores: Tensor,
    scale: float,
    *,
    causal: bool = False,
    mask: Tensor | None = None,
    p: float = 0.0,
    seed: int | None = None,
    offset: int = 0,
) -> Tensor:
    """dropout(softmax(scores * scale + mask)) over the keys of (batch, heads, q_len, k_len) scores.

    ``mask``: any shape that broadcasts to the scores; bool (True = attend, as in
    ``scaled_dot_product_attention``) or floating-point (added to the scaled scores). ``seed``/``offset``
    name the dropout stream; by default a fresh one from torch's generator (``loader.dropout_stream``)."""
    if scores.dim() != 4:
        raise ValueError(f"scores must be (batch, heads, q_len, k_len), got shape {tuple(scores.shape)}")
    _check_input(scores, "scores")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout p must be in [0, 1), got {p}")
    mask = None if mask is None else _additive_mask(mask, scores)
    return _softmax_dropout_fwd(scores, mask, scale, causal, p, _stream(scores, p, seed, offset))[0]


def bias_dropout_residual(
    x: Tensor, bias: Tensor, residual: Tensor, p: float = 0.0, seed: int | None = None, offset: int = 0
) -> Tensor:
    """residual + dropout(x + bias), in the promoted dtype of x and residual (as ``residual + x`` would be:
    under autocast the residual stream stays fp32 while x comes out of a bf16 matmul). ``seed``/``offset``:
    as in ``softmax_dropout``."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout p must be in [0, 1), got {p}")
    _check_input(x)
    _check_input(residual, "residual")
    _check_like("bias", bias, x, x.shape[-1:])
    _check_like("residual", residual, x, tuple(x.shape))
    dtype = torch.promote_types(x.dtype, residual.dtype)
    x, residual = x.to(dtype), residual.to(dtype)
    return _bias_dropout_residual_fwd(x, bias, residual, p, _stream(x, p, seed, offset))


def bias_dropout_residual_layer_norm(
    x: Tensor,
    bias: Tensor,
    residual: Tensor,
    weight: Tensor,
    ln_bias: Tensor,
    p: float = 0.0,
    eps: float = 1e-5,
    seed: int | None = None,
    offset: int = 0,
) -> tuple[Tensor, Tensor]:
    """(hidden, normed): hidden = residual + dropout(x + bias), as ``bias_dropout_residual``, and
    normed = LayerNorm(hidden) over the last dimension: the seam between a pre-LN block's sublayers, where
    the residual stream goes on as ``hidden`` and the next sublayer reads ``normed``. One pass on a GPU
    for rows of up to 8192 columns forward, 4096 backward."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout p must be in [0, 1), got {p}")
    _check_input(x)
    _check_input(residual, "residual")
    _check_like("residual", residual, x, tuple(x.shape))
    for name, t in (("bias", bias), ("weight", weight), ("ln_bias", ln_bias)):
        _check_like(name, t, x, x.shape[-1:])
    dtype = torch.promote_types(x.dtype, residual.dtype)
    x, residual = x.to(dtype), residual.to(dtype)
    stream = _stream(x, p, seed, offset)
    hidden, normed, _, _ = _residual_layer_norm_fwd(x, bias, residual, weight, ln_bias, p, eps, stream)
    return hidden, normed


def _stream(x: Tensor, p: float, seed: int | None, offset: int) -> Tensor | None:
    """The dropout stream on ``x``'s device (none without dropout): the caller's (seed, offset), or without a
    seed a fresh draw from torch's generator (``loader.dropout_stream``), never a fixed default, which
    would drop the same elements on every call."""
    if p == 0.0:
        return None
    if seed is None:
        return dropout_stream(x.device)
    return reference.stream_tensor(seed, offset, x.device)
