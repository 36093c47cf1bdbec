"""The fused ops: CUDA kernels with autograd on CUDA tensors (CuPy present), pure-torch references elsewhere.

Each op takes activations of any leading shape in fp32, fp16 or bf16; parameters (weight, bias) may be
in any float dtype: the kernels read them as fp32 and their gradients come back in their own dtype.
Split as kernels.md advises: kernel source (``cuda_kernels/``) / host launch (here) / autograd.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_zero.kernels import reference
from lightning_zero.kernels.loader import BLOCK, SUFFIX, f32, grid_for, i64, launch, tensor, u64, use_kernels

FLOATS = tuple(SUFFIX)
ROWS_PER_CHUNK = 256  # rows each block of a column reduction sums


def _row_block(cols: int) -> int:
    """Threads per block for one-row-per-block kernels: a multiple of 32, enough for the row, at most 1024."""
    return min(1024, max(32, 1 << (cols - 1).bit_length()))


def _column_sum(data: Tensor, cols: int) -> Tensor:
    """fp32 sums over rows of ``data`` viewed as [rows, cols] (the gradient of a broadcast bias)."""
    rows = data.numel() // cols
    chunks = -(-rows // ROWS_PER_CHUNK)
    partial = torch.empty(chunks, cols, dtype=torch.float32, device=data.device)
    args = (tensor(data, "data", dtypes=FLOATS), i64(rows), i64(cols), i64(ROWS_PER_CHUNK), partial.data_ptr())
    launch("reduce.cu", f"column_sum_partial_{SUFFIX[data.dtype]}", (-(-cols // BLOCK), chunks), BLOCK, args)
    return partial.sum(0)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
        cols = x.shape[-1]
        rows = x.numel() // cols
        w, b = weight.float().contiguous(), bias.float().contiguous()
        y = torch.empty_like(x)
        mean = torch.empty(rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty_like(mean)
        args = (
            tensor(x, "x", dtypes=FLOATS),
            tensor(w, "weight", dtypes=(torch.float32,), like=x),
            tensor(b, "bias", dtypes=(torch.float32,), like=x),
            y.data_ptr(),
            mean.data_ptr(),
            rstd.data_ptr(),
            i64(cols),
            f32(eps),
        )
        launch("layer_norm.cu", f"layer_norm_fwd_{SUFFIX[x.dtype]}", rows, _row_block(cols), args)
        ctx.save_for_backward(x, w, mean, rstd)
        ctx.param_dtypes = (weight.dtype, bias.dtype)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w, mean, rstd = ctx.saved_tensors
        dy = dy.contiguous()
        cols = x.shape[-1]
        rows = x.numel() // cols
        name = SUFFIX[x.dtype]
        dx = torch.empty_like(x)
        launch(
            "layer_norm.cu",
            f"layer_norm_bwd_input_{name}",
            rows,
            _row_block(cols),
            (
                tensor(dy, "dy", dtypes=(x.dtype,), like=x),
                x.data_ptr(),
                w.data_ptr(),
                mean.data_ptr(),
                rstd.data_ptr(),
                dx.data_ptr(),
                i64(cols),
            ),
        )
        chunks = -(-rows // ROWS_PER_CHUNK)
        partial_dw = torch.empty(chunks, cols, dtype=torch.float32, device=x.device)
        partial_db = torch.empty_like(partial_dw)
        launch(
            "layer_norm.cu",
            f"layer_norm_bwd_params_{name}",
            (-(-cols // BLOCK), chunks),
            BLOCK,
            (
                dy.data_ptr(),
                x.data_ptr(),
                mean.data_ptr(),
                rstd.data_ptr(),
                i64(rows),
                i64(cols),
                i64(ROWS_PER_CHUNK),
                partial_dw.data_ptr(),
                partial_db.data_ptr(),
            ),
        )
        w_dtype, b_dtype = ctx.param_dtypes
        return dx, partial_dw.sum(0).to(w_dtype), partial_db.sum(0).to(b_dtype), None


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, bias: Tensor, tanh: bool) -> Tensor:
        b = bias.float().contiguous()
        y = torch.empty_like(x)
        args = (
            tensor(x, "x", dtypes=FLOATS),
            tensor(b, "bias", dtypes=(torch.float32,), like=x),
            y.data_ptr(),
            i64(x.numel()),
            i64(x.shape[-1]),
            int(tanh),
        )
        launch("bias_gelu.cu", f"bias_gelu_fwd_{SUFFIX[x.dtype]}", grid_for(x.numel()), BLOCK, args)
        ctx.save_for_backward(x, b)
        ctx.tanh, ctx.bias_dtype = tanh, bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, b = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        args = (
            tensor(dy, "dy", dtypes=(x.dtype,), like=x),
            x.data_ptr(),
            b.data_ptr(),
            dx.data_ptr(),
            i64(x.numel()),
            i64(x.shape[-1]),
            int(ctx.tanh),
        )
        launch("bias_gelu.cu", f"bias_gelu_bwd_{SUFFIX[x.dtype]}", grid_for(x.numel()), BLOCK, args)
        return dx, _column_sum(dx, x.shape[-1]).to(ctx.bias_dtype), None


class _SoftmaxDropout(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, scores: Tensor, mask: Tensor | None, scale: float, causal: bool, p: float, seed: int, offset: int
    ) -> Tensor:
        batch, heads, q_len, k_len = scores.shape
        probs = torch.empty_like(scores)
        out = torch.empty_like(scores) if p > 0 else probs
        mask_ptr = 0
        if mask is not None:
            mask = mask.float().expand(batch, 1, q_len, k_len).contiguous()
            mask_ptr = tensor(mask, "mask", dtypes=(torch.float32,), like=scores)
        args = (
            tensor(scores, "scores", dtypes=FLOATS),
            mask_ptr,
            probs.data_ptr(),
            out.data_ptr(),
            i64(k_len),
            i64(heads),
            i64(q_len),
            f32(scale),
            int(causal),
            f32(p),
            u64(seed),
            u64(offset),
        )
        rows = batch * heads * q_len
        launch("softmax_dropout.cu", f"softmax_dropout_fwd_{SUFFIX[scores.dtype]}", rows, _row_block(k_len), args)
        ctx.save_for_backward(probs)
        ctx.params = (scale, p, seed, offset)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        (probs,) = ctx.saved_tensors
        scale, p, seed, offset = ctx.params
        dout = dout.contiguous()
        dscores = torch.empty_like(probs)
        k_len = probs.shape[-1]
        args = (
            tensor(dout, "dout", dtypes=(probs.dtype,), like=probs),
            probs.data_ptr(),
            dscores.data_ptr(),
            i64(k_len),
            f32(scale),
            f32(p),
            u64(seed),
            u64(offset),
        )
        launch(
            "softmax_dropout.cu",
            f"softmax_dropout_bwd_{SUFFIX[probs.dtype]}",
            probs.numel() // k_len,
            _row_block(k_len),
            args,
        )
        return dscores, None, None, None, None, None, None


class _BiasDropoutResidual(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, bias: Tensor, residual: Tensor, p: float, seed: int, offset: int) -> Tensor:
        b = bias.float().contiguous()
        y = torch.empty_like(x)
        args = (
            tensor(x, "x", dtypes=FLOATS),
            tensor(b, "bias", dtypes=(torch.float32,), like=x),
            tensor(residual, "residual", dtypes=(x.dtype,), like=x),
            y.data_ptr(),
            i64(x.numel()),
            i64(x.shape[-1]),
            f32(p),
            u64(seed),
            u64(offset),
        )
        launch(
            "bias_dropout_residual.cu", f"bias_dropout_residual_fwd_{SUFFIX[x.dtype]}", grid_for(x.numel()), BLOCK, args
        )
        ctx.params = (p, seed, offset, x.shape[-1], bias.dtype)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        p, seed, offset, cols, bias_dtype = ctx.params
        dy = dy.contiguous()
        if p > 0:
            dx = torch.empty_like(dy)
            args = (tensor(dy, "dy", dtypes=FLOATS), dx.data_ptr(), i64(dy.numel()), f32(p), u64(seed), u64(offset))
            launch("bias_dropout_residual.cu", f"dropout_bwd_{SUFFIX[dy.dtype]}", grid_for(dy.numel()), BLOCK, args)
        else:
            dx = dy
        return dx, _column_sum(dx, cols).to(bias_dtype), dy, None, None, None


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dimension."""
    if use_kernels(x):
        return _LayerNorm.apply(x.contiguous(), weight, bias, eps)
    return reference.layer_norm(x, weight, bias, eps)


def bias_gelu(x: Tensor, bias: Tensor, approximate: str = "tanh") -> Tensor:
    """gelu(x + bias); ``approximate`` is "tanh" (GPT-2's) or "none" (exact erf)."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    if use_kernels(x):
        return _BiasGelu.apply(x.contiguous(), bias, approximate == "tanh")
    return reference.bias_gelu(x, bias, approximate)


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
    """dropout(softmax(scores * scale + mask)) over the keys of (batch, heads, q_len, k_len) scores."""
    if scores.dim() != 4:
        raise ValueError(f"scores must be (batch, heads, q_len, k_len), got shape {tuple(scores.shape)}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout p must be in [0, 1), got {p}")
    if use_kernels(scores):
        return _SoftmaxDropout.apply(scores.contiguous(), mask, scale, causal, p, seed, offset)
    return reference.softmax_dropout(scores, scale, causal=causal, mask=mask, p=p, seed=seed, offset=offset)


def bias_dropout_residual(
    x: Tensor, bias: Tensor, residual: Tensor, p: float = 0.0, seed: int = 0, offset: int = 0
) -> Tensor:
    """residual + dropout(x + bias), in the promoted dtype of x and residual (as ``residual + x`` would be:
    under autocast the residual stream stays fp32 while x comes out of a bf16 matmul)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout p must be in [0, 1), got {p}")
    dtype = torch.promote_types(x.dtype, residual.dtype)
    x, residual = x.to(dtype), residual.to(dtype)
    if use_kernels(x):
        return _BiasDropoutResidual.apply(x.contiguous(), bias, residual.contiguous(), p, seed, offset)
    return reference.bias_dropout_residual(x, bias, residual, p, seed, offset)
