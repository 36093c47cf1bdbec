"""The CUDA kernels themselves, run on the CPU by the emulator (tests/support/cuda_emulator.py): every kernel through
its real host launcher, against the pure-torch references, for fp32, fp16 and bf16, on the vector-pack and
scalar paths, at row widths that take each of the row kernels' layouts. What a GPU adds (its maths library,
real timing and memory) is left to tests/gpu/test_kernels_gpu.py; what it cannot add is here: the index maths,
the reductions, the barriers and the launch arguments run on every machine."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.kernels import adamw as adamw_module
from lightning_zero.kernels import launchers, reference
from lightning_zero.kernels.adamw import check_finite_, fused_adamw_
from tests.support import cuda_emulator
from tests.support.cuda_emulator import LAUNCHED, wide_loads
from tests.support.fused_checks import check_fused_adamw_under_grad_scaler, check_fused_gpt

pytestmark = pytest.mark.usefixtures("emulated_gpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
STREAM = reference.stream_tensor(77, 8)


def _close(got, want, dtype=None):
    dtype = dtype or want.dtype
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# (rows, cols, misaligned start) -> the kernels' layout: a row is held by a warp (37, 64 columns), by a block
# of 128 threads (512 forward, 1024 backward: a row that needs 64 threads takes the whole block, odd row
# counts included), 256 (1504, 1501), or 1024 forward and 512 backward (8192); odd widths and misaligned
# rows element by element, the others in 16-byte packs; wider ones loop
LAYER_NORM_CASES = [
    (3, 37, False),
    (300, 64, False),
    (5, 64, True),
    (3, 512, False),
    (3, 1024, False),
    (2, 1504, False),
    (2, 1501, True),
    (2, 8192, False),
    (2, 8200, False),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols,misaligned", LAYER_NORM_CASES)
def test_layer_norm(dtype, rows, cols, misaligned):
    wide_loads("layer_norm.cu")  # (counted from here)
    x, dy = _randn(rows * cols + 1, dtype=dtype), _randn(rows, cols, dtype=dtype, seed=1)
    x = x[1:] if misaligned else x[:-1]
    x = x.view(rows, cols)
    w, b = _randn(cols, seed=2), _randn(cols, seed=3)
    y, mean, rstd = launchers.layer_norm_fwd(x, w, b, 1e-5)
    packed_loads = [wide_loads("layer_norm.cu")]
    y_ref, mean_ref, rstd_ref = reference.layer_norm_fwd(x, w, b, 1e-5)
    _close(y, y_ref)
    _close(mean, mean_ref)
    _close(rstd, rstd_ref)
    grads = launchers.layer_norm_bwd(dy, x, w, mean, rstd, torch.bfloat16)
    packed_loads.append(wide_loads("layer_norm.cu"))
    for got, want in zip(grads, reference.layer_norm_bwd(dy, x, w, mean_ref, rstd_ref, torch.bfloat16)):
        _close(got, want, dtype if got.shape == x.shape else torch.float32 if got.dtype == torch.float32 else None)
    rows_path = cols <= 8192
    expected = (
        ["layer_norm_fwd_rows", "layer_norm_bwd_rows"] if rows_path else ["layer_norm_fwd", "layer_norm_bwd_input"]
    )
    assert [k.rsplit("_", 1)[0] for k in LAUNCHED][:2] == expected
    packed = rows_path and cols % (16 // x.element_size()) == 0 and not misaligned
    assert [n > 0 for n in packed_loads] == [packed] * 2, "16-byte loads where rows are whole aligned packs, only"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tanh", [True, False])
@pytest.mark.parametrize("cols", [37, 64])  # scalar path, 16-byte packs
def test_bias_gelu(dtype, tanh, cols):
    x, dy, b = _randn(5, cols, dtype=dtype), _randn(5, cols, dtype=dtype, seed=1), _randn(cols, seed=2)
    _close(launchers.bias_gelu_fwd(x, b, tanh), reference.bias_gelu(x, b, "tanh" if tanh else "none"))
    for got, want in zip(launchers.bias_gelu_bwd(dy, x, b, tanh), reference.bias_gelu_bwd(dy, x, b, tanh)):
        _close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,masked,p", [(True, False, 0.0), (False, True, 0.3), (True, True, 0.5)])
# a warp (5, 40 keys: element by element, groups of four straddling rows; 16, 64: packs), a block (512: 128
# threads, 1504 in packs, 1501 not); wider than 8192 keys loop (8201: groups of four straddle rows)
@pytest.mark.parametrize("q_len,k_len", [(5, 5), (3, 40), (5, 16), (3, 64), (3, 512), (2, 1504), (2, 1501), (1, 8201)])
def test_softmax_dropout(dtype, causal, masked, p, q_len, k_len):
    wide_loads("softmax_dropout.cu")
    scores = _randn(2, 2, q_len, k_len, dtype=dtype)
    mask = None
    if masked:  # a padding mask, read through its strides
        mask = torch.zeros(2, 1, 1, k_len).masked_fill_(_randn(2, 1, 1, k_len, seed=4) > 1.0, float("-inf"))
        mask[..., 0] = 0.0
    out, probs = launchers.softmax_dropout_fwd(scores, mask, 0.5, causal, p, STREAM)
    packed_loads = [wide_loads("softmax_dropout.cu")]
    out_ref, probs_ref = reference.softmax_dropout_fwd(scores, mask, 0.5, causal, p, STREAM)
    assert torch.equal(out == 0, out_ref == 0), "the kernel drops other elements than the reference"
    _close(out, out_ref)
    _close(probs, probs_ref)
    dout = _randn(*scores.shape, dtype=dtype, seed=5)
    saved = probs if p > 0 else out
    dscores = launchers.softmax_dropout_bwd(dout, saved, 0.5, p, STREAM)
    packed_loads.append(wide_loads("softmax_dropout.cu"))
    _close(dscores, reference.softmax_dropout_bwd(dout, saved, 0.5, p, STREAM))
    rows_path = k_len <= 8192
    packed = rows_path and k_len % (16 // scores.element_size()) == 0
    assert [n > 0 for n in packed_loads] == [packed] * 2
    suffix = "_rows" if rows_path else ""
    assert [k.rsplit("_", 1)[0] for k in LAUNCHED] == [
        f"softmax_dropout_fwd{suffix}",
        f"softmax_dropout_bwd{suffix}",
    ]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [37, 64])
@pytest.mark.parametrize("p", [0.0, 0.4])
def test_bias_dropout_residual_and_its_backward(dtype, cols, p):
    x, r, b = _randn(6, cols, dtype=dtype), _randn(6, cols, dtype=dtype, seed=1), _randn(cols, seed=2)
    stream = reference.stream_tensor(123, 4) if p > 0 else None
    y = launchers.bias_dropout_residual_fwd(x, b, r, p, stream)
    dropped = ~reference._keep(x.shape, p, 123, 4, x.device)
    assert torch.equal(y[dropped], r[dropped]), "the kernel keeps elements the reference drops"
    _close(y, reference.bias_dropout_residual_fwd(x, b, r, p, stream))
    if p > 0:
        dy = _randn(6, cols, dtype=dtype, seed=3)
        assert torch.equal(launchers.dropout_bwd(dy, p, stream), reference.dropout_bwd(dy, p, stream))
    data = _randn(300, cols, dtype=dtype, seed=6)  # several row chunks
    _close(launchers.column_sum(data, torch.float32), reference.column_sum(data, torch.float32), torch.float32)


@pytest.mark.parametrize("starts", [(0, 0, 0), (1, 1, 1), (3, 3, 3), (1, 2, 3)])
@pytest.mark.parametrize("lowp", [None, torch.float16, torch.bfloat16])
def test_fused_adamw(starts, lowp):
    """Equally misaligned views are peeled to a 16-byte boundary (the emulator aborts on a misaligned vector
    load), unequal ones go one element at a time; a device scale factor and the fp16/bf16 copy."""
    n = 203
    param, m, v = (_randn(n + 4, seed=s)[k : k + n] for s, k in enumerate(starts))
    v.abs_()
    grad = _randn(n, dtype=torch.bfloat16, seed=9)
    out = None if lowp is None else torch.empty(n, dtype=lowp)
    expected = [t.clone() for t in (param, m, v)]
    kwargs = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=3, inv_scale=0.5)
    fused_adamw_(param, grad, m, v, multiplier=torch.tensor(0.25), lowp_out=out, **kwargs)
    reference.adamw_(expected[0], grad, *expected[1:], multiplier=torch.tensor(0.25), **kwargs)
    for got, want in zip((param, m, v), expected):
        _close(got, want)
    if out is not None:
        assert torch.equal(out, param.to(lowp))


def test_an_overflow_flag_skips_the_step():
    grad = _randn(1000, seed=1)
    grad[777] = float("inf")
    flag = torch.zeros(1, dtype=torch.int32)
    check_finite_(grad[:700], flag)
    assert int(flag) == 0
    check_finite_(grad, flag)
    assert int(flag) == 1
    param, m, v = _randn(1000), torch.zeros(1000), torch.zeros(1000)
    before = param.clone()
    fused_adamw_(param, grad, m, v, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1, found_inf=flag)
    assert torch.equal(param, before) and not m.any()


# fused up to 8192 columns forward, 4096 backward: a warp (37: element by element, 64), a block (512, 1024:
# 128 threads, 1504), the largest backward team (4096); forward only (6000); neither (8200: the unfused ops)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [37, 64, 512, 1024, 1504, 4096, 6000, 8200])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_bias_dropout_residual_layer_norm(dtype, cols, p):
    wide_loads("residual_layer_norm.cu")
    rows = 5
    x, r, dn, dh = (_randn(rows, cols, dtype=dtype, seed=s) for s in range(4))
    b, w, lb = (_randn(cols, seed=s) for s in range(4, 7))
    stream = reference.stream_tensor(31, 12) if p > 0 else None
    out = launchers.residual_layer_norm_fwd(x, b, r, w, lb, p, 1e-5, stream)
    packed_loads = [wide_loads("residual_layer_norm.cu")]
    want = reference.residual_layer_norm_fwd(x, b, r, w, lb, p, 1e-5, stream)
    for got, expected in zip(out, want):
        _close(got, expected, dtype if got.shape == x.shape else torch.float32)
    hidden, _, mean, rstd = want
    args = (dn, dh, hidden, w, mean, rstd, p, stream, torch.float32, torch.bfloat16)
    grads = launchers.residual_layer_norm_bwd(*args)
    packed_loads.append(wide_loads("residual_layer_norm.cu"))
    expected = reference.residual_layer_norm_bwd(*args)
    fused_fwd, fused_bwd = cols <= 8192, cols <= 4096
    for got, want_grad in zip(grads, expected):
        _close(got, want_grad, dtype if got.shape == x.shape else torch.float32)
    launched = [k.rsplit("_", 1)[0] for k in LAUNCHED]
    whole_packs = cols % (16 // x.element_size()) == 0
    assert [n > 0 for n in packed_loads] == [fused_fwd and whole_packs, fused_bwd and whole_packs]
    assert ("residual_layer_norm_fwd" in launched) == fused_fwd
    assert ("residual_layer_norm_bwd" in launched) == fused_bwd


def test_fused_block_forward_and_backward_on_the_kernels():
    """The whole FusedBlock GPT, every fused op on the emulated kernels, equals the plain GPT."""
    cfg = dict(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=64)
    check_fused_gpt(cfg, 2, out_tol=1e-5, rtol=1e-5, atol=1e-6)
    kernels = {k.rsplit("_", 1)[0] for k in LAUNCHED}
    assert {"layer_norm_fwd_rows", "residual_layer_norm_fwd", "residual_layer_norm_bwd", "bias_gelu_bwd"} <= kernels


def test_multi_tensor_adamw_steps_every_run_in_one_launch(monkeypatch):
    """Runs of other sizes, alignments, hyper-parameters, gradient factors and output dtypes; spans cut every
    64 elements from each run's 16-byte boundary (SPAN shrunk so small tensors take several); one launch per
    output dtype."""
    monkeypatch.setattr(adamw_module, "SPAN", 64)
    layouts = [
        (203, (1, 1, 1), None),
        (1001, (1, 2, 3), torch.bfloat16),
        (300, (3, 3, 3), torch.bfloat16),
        (5, (0, 0, 0), None),
    ]
    runs, expected = [], []
    for k, (n, starts, lowp) in enumerate(layouts):
        param, m, v = (_randn(n + 4, seed=10 * k + s)[o : o + n] for s, o in enumerate(starts))
        v.abs_()
        hyper = dict(lr=1e-2 * (k + 1), beta1=0.9, beta2=0.99 - 0.01 * k, eps=1e-8, weight_decay=0.1 * k, step=k + 1)
        grad = _randn(n, dtype=torch.bfloat16, seed=10 * k + 9)
        out = None if lowp is None else torch.empty(n, dtype=lowp)
        expected.append([t.clone() for t in (param, m, v)])
        reference.adamw_(
            expected[-1][0], grad, *expected[-1][1:], multiplier=torch.tensor(0.25), inv_scale=0.5 / (k + 1), **hyper
        )
        runs.append(adamw_module.AdamWRun(param, grad, m, v, grad_mul=1 / (k + 1), lowp_out=out, **hyper))
    adamw_module.multi_adamw_(runs, inv_scale=0.5, multiplier=torch.tensor(0.25))
    assert LAUNCHED == ["adamw_multi_bf16_none", "adamw_multi_bf16_bf16"]
    for run, want in zip(runs, expected):
        for got, w in zip((run.param, run.exp_avg, run.exp_avg_sq), want):
            _close(got, w)
        if run.lowp_out is not None:
            assert torch.equal(run.lowp_out, run.param.to(run.lowp_out.dtype))


def test_fused_adamw_under_a_grad_scaler_on_the_kernel():
    """The kernel unscales by the scaler's device scale, skips on its flag and takes its bias corrections from
    the device step counts (a kernel that used the host's would land elsewhere after the skipped step)."""
    check_fused_adamw_under_grad_scaler("cpu")
    assert LAUNCHED == ["adamw_multi_f32_none"] * 5


def test_fused_adamw_optimizer_takes_one_launch():
    model = torch.nn.Sequential(torch.nn.Linear(17, 9), torch.nn.Linear(9, 3))
    twin = torch.nn.Sequential(torch.nn.Linear(17, 9), torch.nn.Linear(9, 3))
    twin.load_state_dict(model.state_dict())
    mine, theirs = adamw_module.FusedAdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(twin.parameters(), lr=1e-2)
    for step in range(3):
        x = _randn(5, 17, seed=step)
        for net, opt in ((model, mine), (twin, theirs)):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    assert LAUNCHED == ["adamw_multi_f32_none"] * 3
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


FAULTY = r"""
extern "C" __global__ void partial_barrier(float* out) {
  if (threadIdx.x < 16) __syncthreads();  // lanes 16-31 of the same warp wait elsewhere
  else __syncwarp();
  out[threadIdx.x] = 1.f;
}
extern "C" __global__ void misaligned_load(const float* in, float* out) {
  out[threadIdx.x] = __ldg(reinterpret_cast<const float4*>(in + 1)).x;
}
"""


def test_the_emulator_reports_what_a_gpu_would_hang_or_fault_on(tmp_path):
    """A __syncthreads that part of a block never reaches, and a 16-byte load from a 4-byte boundary, end the
    launch with an error that names them (and the next launch runs normally)."""
    source = tmp_path / "faulty.cu"
    source.write_text(FAULTY)
    data, out = torch.zeros(64), torch.zeros(64)
    with pytest.raises(RuntimeError, match="partial_barrier: deadlock in block 0: 16 of 32 live threads wait at"):
        cuda_emulator.launch(str(source), "partial_barrier", 1, 64, (out.data_ptr(),), device=out.device)
    with pytest.raises(RuntimeError, match="misaligned_load: misaligned 16-byte load"):
        cuda_emulator.launch(
            str(source), "misaligned_load", 1, 32, (data.data_ptr(), out.data_ptr()), device=out.device
        )
    x, b = _randn(3, 37), _randn(37, seed=1)
    _close(launchers.bias_gelu_fwd(x, b, True), reference.bias_gelu(x, b, "tanh"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n", "block"), [(1, 1000, 256), (3, 300, 64), (2, 7, 256)])
def test_quantize_and_dequantize_equal_the_reference_bitwise(dtype, rows, n, block):
    x = (_randn(rows, n, seed=9) * torch.logspace(-3, 2, n)).to(dtype)
    x[0, :block] = 0  # an all-zero block: scale 0
    if n > 2 * block:
        x[0, block + 3], x[0, 2 * block + 1] = float("inf"), float("nan")  # non-finite blocks stay non-finite
    values, scales = launchers.quantize_blocks(x, block)
    want_values, want_scales = reference.quantize_blocks(x, block)
    assert torch.equal(values, want_values) and torch.equal(scales, want_scales)
    out, want = torch.empty(rows, n, dtype=dtype), torch.empty(rows, n, dtype=dtype)
    launchers.dequantize_blocks(out, values, scales, block)
    reference.dequantize_blocks(want, values, scales, block)
    assert torch.equal(out.isfinite(), want.isfinite()) and torch.equal(out.nan_to_num(), want.nan_to_num())
    if n > 2 * block:
        assert not out[0, block : 3 * block].isfinite().any()
