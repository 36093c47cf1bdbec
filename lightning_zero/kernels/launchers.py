"""Host launch of each CUDA kernel: checked pointers in, torch-allocated outputs back (see loader.py's
[Note: launching]). Forward and backward are separate plain functions, so ``ops.py`` can register them as
torch custom ops; each mirrors a function of the same name in ``reference.py``.

Parameters (weight, bias) of any float dtype are read as fp32; their gradients come back in their own
dtype, summed over rows in fp32 first.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_zero.kernels.loader import BLOCK, SUFFIX, f32, grid_for, i64, launch, tensor

FLOATS = tuple(SUFFIX)
MAX_GRID_Y = 65535


def _row_block(cols: int) -> int:
    """Threads per block for one-row-per-block kernels: a multiple of 32, enough for the row, at most 1024."""
    return min(1024, max(32, 1 << (cols - 1).bit_length()))


def row_chunks(rows: int, cols: int, sms: int) -> tuple[int, int]:
    """(chunks, rows per chunk) of a column reduction over [rows, cols]: blocks of BLOCK columns times chunks
    of rows, 2-4 blocks per SM when the rows allow (fewer columns, more chunks), at most 65535 chunks
    (a grid's y limit: more rows make longer chunks, never a failed launch)."""
    column_blocks = -(-cols // BLOCK)
    chunks = max(1, min(rows, MAX_GRID_Y, -(-4 * sms // column_blocks)))
    per_chunk = -(-rows // chunks)
    return -(-rows // per_chunk), per_chunk


def _stream(stream: Tensor | None, like: Tensor) -> int:
    """The device pointer of a dropout stream (two int64s: seed, offset), or null without dropout."""
    return 0 if stream is None else tensor(stream, "stream", dtypes=(torch.int64,), like=like)


def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _column_sum(data: Tensor, cols: int) -> Tensor:
    """fp32 sums over rows of ``data`` viewed as [rows, cols] (the gradient of a broadcast bias)."""
    rows = data.numel() // cols
    chunks, per_chunk = row_chunks(rows, cols, _sms(data.device))
    partial = torch.empty(chunks, cols, dtype=torch.float32, device=data.device)
    args = (tensor(data, "data", dtypes=FLOATS), i64(rows), i64(cols), i64(per_chunk), partial.data_ptr())
    grid = (-(-cols // BLOCK), chunks)
    launch("reduce.cu", f"column_sum_partial_{SUFFIX[data.dtype]}", grid, BLOCK, args, device=data.device)
    return partial.sum(0)


# [Note: row teams] in cuda_kernels/rows.cuh: rows of at most 8192 columns stay in registers (moved in
# 16-byte packs when every row is whole packs and 16-byte aligned, else element by element); forward
# kernels hold 8 elements a thread in teams of up to 1024 threads, backward kernels 16 in teams of up to 512.
FWD_ROWS, BWD_ROWS = (8, 1024), (16, 512)  # (elements a thread holds, the largest team)


def _row_team(cols: int, kind: tuple[int, int]) -> int | None:
    """The team size of a row kernel for rows of ``cols``, or None when the rows take the looping kernels."""
    elems, largest = kind
    if cols > elems * largest:
        return None
    need = -(-cols // elems)  # threads the row needs
    return 32 if need <= 32 else max(128, 1 << (need - 1).bit_length())  # a warp, or a whole block (>= 128)


def _row_grid(rows: int, team: int, sms: int, threads_per_sm: int) -> tuple[int, int, int]:
    """(blocks, threads a block, teams): a warp team shares a 128-thread block with three others, a larger team
    is its block (never two teams of more than a warp in a block: their reductions span the block); teams walk
    the rows with a stride, the grid at most ``threads_per_sm`` threads an SM (each team's partial sums
    of parameter gradients are a row of the backward's partial buffers)."""
    block = max(team, 128)
    per_block = block // team
    blocks = max(1, min(-(-rows // per_block), sms * max(1, threads_per_sm // block)))
    return blocks, block, blocks * per_block


def layer_norm_fwd(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """y, and each row's mean and 1/std in fp32 (for backward)."""
    x = x.contiguous()
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
    )
    team = _row_team(cols, FWD_ROWS)
    if team is None:
        kernel, grid, block, args = "layer_norm_fwd", rows, _row_block(cols), (*args, i64(cols), f32(eps))
    else:
        grid, block, _ = _row_grid(rows, team, _sms(x.device), 2048)
        vec = int(_pack(cols, x, y) > 1)
        kernel, args = "layer_norm_fwd_rows", (*args, i64(rows), int(cols), int(team), vec, f32(eps))
    launch("layer_norm.cu", f"{kernel}_{SUFFIX[x.dtype]}", grid, block, args, device=x.device)
    return y, mean, rstd


def layer_norm_bwd(
    dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor, bias_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias) from the forward's ``mean`` and ``rstd``: in one pass when a row fits a team, else
    dx by one kernel and the parameters' gradients by a column reduction."""
    x, dy, w = x.contiguous(), dy.contiguous(), weight.float().contiguous()
    cols = x.shape[-1]
    rows = x.numel() // cols
    name = SUFFIX[x.dtype]
    dx = torch.empty_like(x)
    checked = (tensor(dy, "dy", dtypes=(x.dtype,), like=x), x.data_ptr(), w.data_ptr(), mean.data_ptr())
    team = _row_team(cols, BWD_ROWS)
    if team is not None:  # one pass: dx, and each team's partial sums of dweight and dbias
        grid, block, teams = _row_grid(rows, team, _sms(x.device), 1024)
        partial_dw = torch.empty(teams, cols, dtype=torch.float32, device=x.device)
        partial_db = torch.empty_like(partial_dw)
        args = (*checked, rstd.data_ptr(), dx.data_ptr(), partial_dw.data_ptr(), partial_db.data_ptr())
        vec = int(_pack(cols, dy, x, dx) > 1)
        args = (*args, i64(rows), int(cols), int(team), vec)
        launch("layer_norm.cu", f"layer_norm_bwd_rows_{name}", grid, block, args, device=x.device)
        return dx, partial_dw.sum(0).to(weight.dtype), partial_db.sum(0).to(bias_dtype)
    args = (*checked, rstd.data_ptr(), dx.data_ptr(), i64(cols))
    launch("layer_norm.cu", f"layer_norm_bwd_input_{name}", rows, _row_block(cols), args, device=x.device)
    chunks, per_chunk = row_chunks(rows, cols, _sms(x.device))
    partial_dw = torch.empty(chunks, cols, dtype=torch.float32, device=x.device)
    partial_db = torch.empty_like(partial_dw)
    pointers = (dy.data_ptr(), x.data_ptr(), mean.data_ptr(), rstd.data_ptr())
    sizes = (i64(rows), i64(cols), i64(per_chunk))
    args = (*pointers, *sizes, partial_dw.data_ptr(), partial_db.data_ptr())
    grid = (-(-cols // BLOCK), chunks)
    launch("layer_norm.cu", f"layer_norm_bwd_params_{name}", grid, BLOCK, args, device=x.device)
    return dx, partial_dw.sum(0).to(weight.dtype), partial_db.sum(0).to(bias_dtype)


def _pack(n: int, *tensors: Tensor) -> int:
    """Elements per thread step: a 16-byte pack when ``n`` (the elements, or a row's) splits into packs and
    every tensor is 16-byte aligned (the kernels' ``vec`` path), else 1."""
    per_pack = 16 // tensors[0].element_size()
    return per_pack if n % per_pack == 0 and all(t.data_ptr() % 16 == 0 for t in tensors) else 1


def bias_gelu_fwd(x: Tensor, bias: Tensor, tanh: bool) -> Tensor:
    """GELU(x + bias) in ``x``'s dtype, of the tanh approximation with ``tanh``, else the exact one."""
    x, b = x.contiguous(), bias.float().contiguous()
    y = torch.empty_like(x)
    pack = _pack(x.numel(), x, y)
    args = (
        tensor(x, "x", dtypes=FLOATS),
        tensor(b, "bias", dtypes=(torch.float32,), like=x),
        y.data_ptr(),
        i64(x.numel()),
        i64(x.shape[-1]),
        int(tanh),
        int(pack > 1),
    )
    kernel = f"bias_gelu_fwd_{SUFFIX[x.dtype]}"
    launch("bias_gelu.cu", kernel, grid_for(x.numel(), pack), BLOCK, args, device=x.device)
    return y


def bias_gelu_bwd(dy: Tensor, x: Tensor, bias: Tensor, tanh: bool) -> tuple[Tensor, Tensor]:
    """(dx, dbias) of ``bias_gelu_fwd``: dx in ``x``'s dtype, dbias its column sum in ``bias``' dtype."""
    x, dy, b = x.contiguous(), dy.contiguous(), bias.float().contiguous()
    dx = torch.empty_like(x)
    pack = _pack(x.numel(), dy, x, dx)
    args = (
        tensor(dy, "dy", dtypes=(x.dtype,), like=x),
        x.data_ptr(),
        b.data_ptr(),
        dx.data_ptr(),
        i64(x.numel()),
        i64(x.shape[-1]),
        int(tanh),
        int(pack > 1),
    )
    kernel = f"bias_gelu_bwd_{SUFFIX[x.dtype]}"
    launch("bias_gelu.cu", kernel, grid_for(x.numel(), pack), BLOCK, args, device=x.device)
    return dx, _column_sum(dx, x.shape[-1]).to(bias.dtype)


def softmax_dropout_fwd(
    scores: Tensor, mask: Tensor | None, scale: float, causal: bool, p: float, stream: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The output and, with dropout, the probabilities backward needs (without, they are the output: an
    empty tensor instead). ``mask``: additive fp32, broadcastable to the scores (ops.softmax_dropout checks
    it), read through its strides, never expanded."""
    scores = scores.contiguous()
    batch, heads, q_len, k_len = scores.shape
    probs = torch.empty_like(scores)
    out = torch.empty_like(scores) if p > 0 else probs  # without dropout the output is the probabilities
    mask_ptr, strides = 0, (0, 0, 0)
    if mask is not None:
        mask = mask.expand(batch, heads, q_len, k_len)
        mask = mask if mask.stride(-1) == 1 else mask.contiguous()  # a mask constant over the keys
        if mask.dtype != torch.float32 or mask.device != scores.device:
            raise ValueError(f"mask must be fp32 on {scores.device}, got {mask.dtype} on {mask.device}")
        mask_ptr, strides = mask.data_ptr(), mask.stride()[:3]
    head = (tensor(scores, "scores", dtypes=FLOATS), mask_ptr, *map(i64, strides), probs.data_ptr(), out.data_ptr())
    tail = (i64(heads), i64(q_len), f32(scale), int(causal), f32(p), _stream(stream, scores))
    rows, team = batch * heads * q_len, _row_team(k_len, FWD_ROWS)
    if team is None:
        kernel, grid, block, args = "softmax_dropout_fwd", rows, _row_block(k_len), (*head, i64(k_len), *tail)
    else:
        grid, block, _ = _row_grid(rows, team, _sms(scores.device), 2048)
        vec = int(_pack(k_len, scores, probs, out) > 1)
        kernel, args = "softmax_dropout_fwd_rows", (*head, i64(rows), int(k_len), *tail, int(team), vec)
    launch("softmax_dropout.cu", f"{kernel}_{SUFFIX[scores.dtype]}", grid, block, args, device=scores.device)
    return out, (probs if p > 0 else probs.new_empty(0))


def softmax_dropout_bwd(dout: Tensor, probs: Tensor, scale: float, p: float, stream: Tensor | None) -> Tensor:
    """The scores' gradient from the forward's probabilities ``probs``, through dropout with ``stream``'s mask."""
    dout = dout.contiguous()
    dscores = torch.empty_like(probs)
    k_len = probs.shape[-1]
    head = (tensor(dout, "dout", dtypes=(probs.dtype,), like=probs), probs.data_ptr(), dscores.data_ptr())
    tail = (f32(scale), f32(p), _stream(stream, probs))
    rows, team = probs.numel() // k_len, _row_team(k_len, FWD_ROWS)
    if team is None:
        kernel, grid, block, args = "softmax_dropout_bwd", rows, _row_block(k_len), (*head, i64(k_len), *tail)
    else:
        grid, block, _ = _row_grid(rows, team, _sms(probs.device), 2048)
        vec = int(_pack(k_len, dout, probs, dscores) > 1)
        kernel, args = "softmax_dropout_bwd_rows", (*head, i64(rows), int(k_len), *tail, int(team), vec)
    launch("softmax_dropout.cu", f"{kernel}_{SUFFIX[probs.dtype]}", grid, block, args, device=probs.device)
    return dscores


def bias_dropout_residual_fwd(x: Tensor, bias: Tensor, residual: Tensor, p: float, stream: Tensor | None) -> Tensor:
    """residual + dropout(x + bias), in ``x``'s dtype (``residual`` must have it too)."""
    x, residual, b = x.contiguous(), residual.contiguous(), bias.float().contiguous()
    y = torch.empty_like(x)
    pack = _pack(x.numel(), x, residual, y)
    args = (
        tensor(x, "x", dtypes=FLOATS),
        tensor(b, "bias", dtypes=(torch.float32,), like=x),
        tensor(residual, "residual", dtypes=(x.dtype,), like=x),
        y.data_ptr(),
        i64(x.numel()),
        i64(x.shape[-1]),
        f32(p),
        _stream(stream, x),
        int(pack > 1),
    )
    kernel = f"bias_dropout_residual_fwd_{SUFFIX[x.dtype]}"
    launch("bias_dropout_residual.cu", kernel, grid_for(x.numel(), max(pack, 4)), BLOCK, args, device=x.device)
    return y


def dropout_bwd(dy: Tensor, p: float, stream: Tensor) -> Tensor:
    """The gradient through dropout: dy where kept (scaled by 1 / (1 - p)), zero where dropped."""
    dy = dy.contiguous()
    dx = torch.empty_like(dy)
    pack = _pack(dy.numel(), dy, dx)
    args = (
        tensor(dy, "dy", dtypes=FLOATS),
        dx.data_ptr(),
        i64(dy.numel()),
        f32(p),
        _stream(stream, dy),
        int(pack > 1),
    )
    kernel = f"dropout_bwd_{SUFFIX[dy.dtype]}"
    launch("bias_dropout_residual.cu", kernel, grid_for(dy.numel(), max(pack, 4)), BLOCK, args, device=dy.device)
    return dx


def column_sum(data: Tensor, dtype: torch.dtype) -> Tensor:
    """The gradient of a bias broadcast over ``data``'s rows (its last dimension), in ``dtype``."""
    return _column_sum(data.contiguous(), data.shape[-1]).to(dtype)


RESIDUAL_BWD_ROWS = (16, 256)  # its backward keeps three partial sums: 16 elements a thread, teams of up to 256


def residual_layer_norm_fwd(
    x: Tensor, bias: Tensor, residual: Tensor, weight: Tensor, ln_bias: Tensor, p: float, eps: float, stream
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(hidden, normed, mean, rstd): one pass over x and residual where the rows fit the row kernels, else
    the two ops it fuses."""
    x, residual = x.contiguous(), residual.contiguous()
    cols = x.shape[-1]
    rows = x.numel() // cols
    hidden, normed = torch.empty_like(x), torch.empty_like(x)
    team = _row_team(cols, FWD_ROWS)
    if team is None:
        hidden = bias_dropout_residual_fwd(x, bias, residual, p, stream)
        return (hidden, *layer_norm_fwd(hidden, weight, ln_bias, eps))
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    b, w, lb = (t.float().contiguous() for t in (bias, weight, ln_bias))  # (held until the launch)
    args = (
        tensor(x, "x", dtypes=FLOATS),
        tensor(b, "bias", dtypes=(torch.float32,), like=x),
        tensor(residual, "residual", dtypes=(x.dtype,), like=x),
        tensor(w, "weight", dtypes=(torch.float32,), like=x),
        tensor(lb, "ln_bias", dtypes=(torch.float32,), like=x),
        hidden.data_ptr(),
        normed.data_ptr(),
        mean.data_ptr(),
        rstd.data_ptr(),
        i64(rows),
        int(cols),
        f32(p),
        _stream(stream, x),
        f32(eps),
        int(team),
        int(_pack(cols, x, residual, hidden, normed) > 1),
    )
    grid, block, _ = _row_grid(rows, team, _sms(x.device), 2048)
    launch("residual_layer_norm.cu", f"residual_layer_norm_fwd_{SUFFIX[x.dtype]}", grid, block, args, device=x.device)
    return hidden, normed, mean, rstd


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
    """(dx, dbias, dresidual, dweight, dln_bias) in one pass over dnormed, dhidden and hidden where the rows
    fit (at most 4096 columns: three partial sums a thread), else the unfused ops' backward passes."""
    dnormed, dhidden, w = dnormed.contiguous(), dhidden.contiguous(), weight.float().contiguous()
    cols = hidden.shape[-1]
    rows = hidden.numel() // cols
    dx, dresidual = torch.empty_like(hidden), torch.empty_like(hidden)
    team = _row_team(cols, RESIDUAL_BWD_ROWS)
    if team is None:  # the unfused kernels, in fp32 as the fused pass computes: one rounding per output
        dh, dweight, dln_bias = layer_norm_bwd(dnormed.float(), hidden.float(), weight, mean, rstd, ln_bias_dtype)
        dh += dhidden
        dx = dropout_bwd(dh, p, stream) if p > 0 else dh
        dx_out = dx.to(hidden.dtype, copy=True)  # (a copy: outputs of a custom op never alias)
        return dx_out, column_sum(dx, bias_dtype), dh.to(hidden.dtype), dweight, dln_bias
    grid, block, teams = _row_grid(rows, team, _sms(hidden.device), 1024)
    partials = torch.empty(3, teams, cols, dtype=torch.float32, device=hidden.device)
    args = (
        tensor(dnormed, "dnormed", dtypes=(hidden.dtype,), like=hidden),
        tensor(dhidden, "dhidden", dtypes=(hidden.dtype,), like=hidden),
        tensor(hidden, "hidden", dtypes=FLOATS),
        w.data_ptr(),
        mean.data_ptr(),
        rstd.data_ptr(),
        dx.data_ptr(),
        dresidual.data_ptr(),
        *(partial.data_ptr() for partial in partials),
        i64(rows),
        int(cols),
        f32(p),
        _stream(stream, hidden),
        int(team),
        int(_pack(cols, dnormed, dhidden, hidden, dx, dresidual) > 1),
    )
    kernel = f"residual_layer_norm_bwd_{SUFFIX[hidden.dtype]}"
    launch("residual_layer_norm.cu", kernel, grid, block, args, device=hidden.device)
    dweight, dln_bias, dbias = (partial.sum(0) for partial in partials)  # (three tensors: outputs never alias)
    return dx, dbias.to(bias_dtype), dresidual, dweight.to(weight.dtype), dln_bias.to(ln_bias_dtype)


def quantize_blocks(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """int8 values and fp32 scales of ``x``'s rows in blocks of ``block`` elements (one CUDA block each)."""
    n = x.shape[-1]
    rows, per_row = (x.numel() // n if n else 0), -(-n // block)
    values = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scales = torch.empty(*x.shape[:-1], per_row, dtype=torch.float32, device=x.device)
    if rows * per_row:
        args = (tensor(x, "x", dtypes=FLOATS), i64(rows), i64(n), i64(block), values.data_ptr(), scales.data_ptr())
        launch("quantize.cu", f"quantize_blocks_{SUFFIX[x.dtype]}", rows * per_row, BLOCK, args, device=x.device)
    return values, scales


def dequantize_blocks(out: Tensor, values: Tensor, scales: Tensor, block: int) -> None:
    """``out`` = each value times its block's scale, in ``out``'s dtype (``values`` and ``out``: (..., n))."""
    n = values.shape[-1]
    rows = values.numel() // n if n else 0
    if rows == 0:
        return
    args = (
        tensor(values, "values", dtypes=(torch.int8,), like=out),
        tensor(scales, "scales", dtypes=(torch.float32,), like=out),
        i64(rows),
        i64(n),
        i64(block),
        tensor(out, "out", dtypes=FLOATS),
    )
    launch("quantize.cu", f"dequantize_blocks_{SUFFIX[out.dtype]}", grid_for(rows * n), BLOCK, args, device=out.device)
