"""The CUDA kernels on a GPU (skipped without one): each against an fp64 reference with flash-attention's
rule (its error at most twice that of torch's same-precision implementation), odd sizes, outputs and
every gradient, fresh random inputs, output memory poisoned with NaN before each launch; fused AdamW
against torch.optim.AdamW over 10 steps; dropout bit for bit the CPU reference's Philox stream."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from lightning_zero.kernels import launchers, loader, ops, reference
from lightning_zero.kernels.adamw import FusedAdamW, check_finite_, fused_adamw_
from lightning_zero.models.gpt import GPT, GPTConfig
from tests.support.fused_checks import check_fused_adamw_under_grad_scaler, check_fused_gpt

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or loader._cupy() is None, reason="needs a CUDA GPU and CuPy"
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (rows, cols) with 7 or 9 rows each: odd sizes (row kernels element by element), rows of packs held by a warp
# over 700 rows (teams' partial sums), by blocks of 128..1024 threads, up to the widest row kernels take, and
# wider (looping kernels)
ROWS_COLS = [(1, 1023), (3, 1500), (5, 997), (4, 1024), (100, 64), (3, 512), (2, 4096), (2, 8192), (1, 9001)]


def _poison() -> None:
    """Fills free allocator memory with NaN, so an output element a kernel forgets to write shows: a large
    block for the large pool, and blocks of every size up to 1 MiB for the small pool, where small outputs
    (a bias gradient, a row's mean) come from."""
    blocks = [torch.full((64 * 2**20,), float("nan"), device="cuda")]
    blocks += [torch.full((2**k,), float("nan"), device="cuda") for k in range(7, 19) for _ in range(8)]
    del blocks


def _run(fn, inputs, grad_out):
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    _poison()
    out = fn(*inputs)
    _poison()
    out.backward(grad_out.to(out.dtype))
    return [out.detach()] + [t.grad for t in inputs if t.requires_grad]


def _flash_rule(kernel, torch_same, exact, what):
    for k, t, e, name in zip(kernel, torch_same, exact, ["out"] + [f"grad{i}" for i in range(len(kernel) - 1)]):
        assert torch.isfinite(k).all(), f"{what} {name}: non-finite values (unwritten memory?)"
        err_k = (k.double() - e).abs().max().item()
        err_t = (t.double() - e).abs().max().item()
        floor = 1e-6 * max(e.abs().max().item(), 1.0)
        assert err_k <= 2 * err_t + floor, f"{what} {name}: kernel error {err_k:.3e} > 2 x torch's {err_t:.3e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", ROWS_COLS)
def test_layer_norm(dtype, rows, cols):
    x = torch.randn(rows, 7, cols, device="cuda", dtype=dtype)
    w, b = torch.randn(cols, device="cuda"), torch.randn(cols, device="cuda")
    g = torch.randn(rows, 7, cols, device="cuda")
    torch_ln = lambda x, w, b: F.layer_norm(x, (cols,), w.to(x.dtype), b.to(x.dtype))  # noqa: E731
    kernel = _run(ops.layer_norm, [x, w, b], g)
    same = _run(torch_ln, [x, w, b], g)
    exact = _run(torch_ln, [x.double(), w.double(), b.double()], g.double())
    _flash_rule(kernel, same, exact, f"layer_norm {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("rows,cols", ROWS_COLS)
def test_bias_gelu(dtype, approximate, rows, cols):
    x, b = torch.randn(rows, 9, cols, device="cuda", dtype=dtype), torch.randn(cols, device="cuda")
    g = torch.randn(rows, 9, cols, device="cuda")
    torch_fn = lambda x, b: F.gelu(x + b.to(x.dtype), approximate=approximate)  # noqa: E731
    kernel = _run(lambda x, b: ops.bias_gelu(x, b, approximate), [x, b], g)
    _flash_rule(
        kernel,
        _run(torch_fn, [x, b], g),
        _run(torch_fn, [x.double(), b.double()], g.double()),
        f"bias_gelu {approximate} {dtype}",
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,with_mask", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize(
    "q_len,k_len", [(17, 17), (13, 1023), (1, 1500), (64, 64), (9, 1024), (2, 8192), (3, 197), (1, 9001)]
)
def test_softmax(dtype, causal, with_mask, q_len, k_len):
    scores = torch.randn(2, 3, q_len, k_len, device="cuda", dtype=dtype)
    mask = (torch.rand(2, 1, q_len, k_len, device="cuda") < 0.2).float() * -1e4 if with_mask else None
    g = torch.randn_like(scores, dtype=torch.float32)

    def torch_fn(s):
        x = s * 0.125 + (mask.to(s.dtype) if mask is not None else 0)
        if causal:
            hidden = torch.ones(q_len, k_len, dtype=torch.bool, device="cuda").triu(k_len - q_len + 1)
            x = x.masked_fill(hidden, float("-inf"))
        return torch.softmax(x, dim=-1)

    kernel = _run(lambda s: ops.softmax_dropout(s, 0.125, causal=causal, mask=mask), [scores], g)
    _flash_rule(kernel, _run(torch_fn, [scores], g), _run(torch_fn, [scores.double()], g.double()), f"softmax {dtype}")


@pytest.mark.parametrize("shape", [(2, 1, 1, 37), (1, 3, 5, 37), (5, 37), (2, 3, 5, 37)])
def test_softmax_masks_are_read_through_their_strides(shape):
    """Padding, per-head and 2-D masks (bool: True attends) without expanding them, as the CPU reference."""
    scores = torch.randn(2, 3, 5, 37, device="cuda")
    mask = torch.rand(shape, device="cuda") > 0.3
    mask[..., 0] = True
    out = ops.softmax_dropout(scores, 0.5, mask=mask)
    expected = ops.softmax_dropout(scores.cpu(), 0.5, mask=mask.cpu())
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_dropout_residual_without_dropout(dtype):
    x, b, r = (
        torch.randn(3, 1023, device="cuda", dtype=dtype),
        torch.randn(1023, device="cuda"),
        torch.randn(3, 1023, device="cuda", dtype=dtype),
    )
    g = torch.randn(3, 1023, device="cuda")
    torch_fn = lambda x, b, r: x + b.to(x.dtype) + r  # noqa: E731
    kernel = _run(lambda x, b, r: ops.bias_dropout_residual(x, b, r), [x, b, r], g)
    _flash_rule(
        kernel,
        _run(torch_fn, [x, b, r], g),
        _run(torch_fn, [x.double(), b.double(), r.double()], g.double()),
        f"bias_dropout_residual {dtype}",
    )


def test_dropout_is_the_cpu_references_philox_stream_with_the_right_keep_rate():
    scores = torch.randn(4, 4, 64, 997, device="cuda")
    out = ops.softmax_dropout(scores, 1.0, p=0.3, seed=12345, offset=6)
    expected = reference.softmax_dropout(scores.cpu(), 1.0, p=0.3, seed=12345, offset=6)
    assert torch.equal(out.cpu() != 0, expected != 0), "the kernel's dropout mask differs from the reference's"
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-7)
    assert torch.equal(out, ops.softmax_dropout(scores, 1.0, p=0.3, seed=12345, offset=6))
    assert abs(float((out != 0).float().mean()) - 0.7) < 0.005
    for cols, dtype in ((999, torch.float32), (1024, torch.float32), (1024, torch.bfloat16)):  # packs: 1024
        x, r = torch.randn(8, cols, device="cuda", dtype=dtype), torch.randn(8, cols, device="cuda", dtype=dtype)
        b = torch.randn(cols, device="cuda")
        y = ops.bias_dropout_residual(x, b, r, p=0.5, seed=99)
        assert torch.equal(
            y.cpu(), reference.bias_dropout_residual_fwd(x.cpu(), b.cpu(), r.cpu(), 0.5, reference.stream_tensor(99, 0))
        )
        dy = torch.randn_like(x)
        dx = torch.ops.lightning_zero.dropout_bwd(dy, 0.5, reference.stream_tensor(99, 0, "cuda"))
        assert torch.equal(dx.cpu(), reference.dropout_bwd(dy.cpu(), 0.5, reference.stream_tensor(99, 0)))


@pytest.mark.parametrize("n", [1023, 1500, 4 * 997, 4096])  # odd sizes, and one the vectorized path takes
@pytest.mark.parametrize("grad_dtype", DTYPES)
def test_fused_adamw_matches_torch_over_ten_steps(n, grad_dtype):
    param = torch.randn(n, device="cuda")
    theirs = param.clone()
    m, v = torch.zeros_like(param), torch.zeros_like(param)
    torch_opt = torch.optim.AdamW([theirs], lr=1e-2, weight_decay=0.1)
    lowp = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    for step in range(1, 11):
        grad = torch.randn(n, device="cuda").to(grad_dtype)
        theirs.grad = grad.float()
        torch_opt.step()
        fused_adamw_(
            param,
            (grad.float() * 256).to(grad_dtype),
            m,
            v,
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.1,
            step=step,
            inv_scale=1 / 256,
            lowp_out=lowp,
        )
    tol = 1e-5 if grad_dtype == torch.float32 else 1e-3
    torch.testing.assert_close(param, theirs, rtol=tol, atol=tol)
    assert torch.equal(lowp, param.bfloat16())


def test_fused_adamw_skips_on_a_device_flag_without_a_sync():
    param, grad = torch.randn(1000, device="cuda"), torch.randn(1000, device="cuda")
    grad[123] = float("nan")
    m, v, flag = (
        torch.zeros(1000, device="cuda"),
        torch.zeros(1000, device="cuda"),
        torch.zeros(1, dtype=torch.int32, device="cuda"),
    )
    before = param.clone()
    check_finite_(grad, flag)
    fused_adamw_(param, grad, m, v, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1, found_inf=flag)
    assert int(flag) == 1 and torch.equal(param, before) and not m.any()


def test_fused_adamw_optimizer_on_gpu():
    model = torch.nn.Linear(257, 129).cuda()
    reference_model = torch.nn.Linear(257, 129).cuda()
    reference_model.load_state_dict(model.state_dict())
    mine, theirs = FusedAdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(reference_model.parameters(), lr=1e-3)
    for _ in range(10):
        x = torch.randn(33, 257, device="cuda")
        for m, opt in ((model, mine), (reference_model, theirs)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@contextlib.contextmanager
def _no_host_sync():
    """CUDA raises on any operation that waits for the device (``.item()``, a blocking copy) inside."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_fused_adamw_under_a_grad_scaler_never_waits_for_the_gpu():
    """GradScaler's step and update with FusedAdamW, an overflowed step included, without one host sync."""
    check_fused_adamw_under_grad_scaler("cuda", guard=_no_host_sync)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_fused_block_on_gpu(dtype, tol):
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, block_size=128, n_layer=2, n_head=4, n_embd=256)
    plain, fused = GPT(GPTConfig(**cfg)).cuda(), GPT(GPTConfig(**cfg, fused=True)).cuda()
    fused.load_state_dict(plain.state_dict())
    idx = torch.randint(64, (4, 128), device="cuda")
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        out_plain, out_fused = plain(idx), fused(idx)
    torch.testing.assert_close(out_fused.float(), out_plain.float(), rtol=tol, atol=tol)


def test_dropout_streams_come_from_the_cuda_generator():
    """Without a seed each call takes a fresh stream from torch's CUDA generator: torch.manual_seed governs it."""
    x, b, r = torch.randn(64, 64, device="cuda"), torch.zeros(64, device="cuda"), torch.zeros(64, 64, device="cuda")
    torch.manual_seed(3)
    first, second = (ops.bias_dropout_residual(x, b, r, p=0.5) for _ in range(2))
    assert not torch.equal(first == 0, second == 0)
    torch.manual_seed(3)
    assert torch.equal(ops.bias_dropout_residual(x, b, r, p=0.5), first)


@pytest.mark.parametrize("starts", [(0, 0, 0), (1, 1, 1), (3, 3, 3), (1, 2, 3)])
def test_fused_adamw_on_misaligned_views(starts):
    """ZeRO's piece views start anywhere: equally misaligned buffers are peeled to a 16-byte boundary (the
    vector path), unequal ones go one element at a time; both equal the reference."""
    n = 1001
    param, m, v = (torch.randn(n + 4, device="cuda")[s : s + n] for s in starts)
    v.abs_()
    grad = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    expected = [t.cpu().clone() for t in (param, m, v)]
    kwargs = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=3, inv_scale=0.5)
    fused_adamw_(param, grad, m, v, **kwargs)
    reference.adamw_(*expected[:1], grad.cpu(), *expected[1:], **kwargs)
    for got, want in zip((param, m, v), expected):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)


def test_dropout_under_a_cuda_graph_draws_a_new_mask_on_every_replay():
    """The stream is drawn on the device inside the graph (torch's graph-safe generator), so replays differ."""
    x, b, r = torch.randn(64, 64, device="cuda"), torch.zeros(64, device="cuda"), torch.zeros(64, 64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.bias_dropout_residual(x, b, r, p=0.5)  # compiles the kernel outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.bias_dropout_residual(x, b, r, p=0.5)
    graph.replay()
    first = out.clone()
    graph.replay()
    assert not torch.equal(first == 0, out == 0)
    assert abs(float((out == 0).float().mean()) - 0.5) < 0.05


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [37, 64, 1504, 4096, 6000])  # unfused, warp, block, widest fused backward, fwd only
def test_bias_dropout_residual_layer_norm(dtype, cols):
    x, r = (torch.randn(5, 7, cols, device="cuda", dtype=dtype) for _ in range(2))
    b, w, lb = (torch.randn(cols, device="cuda") for _ in range(3))
    g = torch.randn(2, 5, 7, cols, device="cuda")

    def fused(x, b, r, w, lb):
        return torch.stack(ops.bias_dropout_residual_layer_norm(x, b, r, w, lb))

    def plain(x, b, r, w, lb):
        hidden = r + (x + b.to(x.dtype))
        return torch.stack([hidden, F.layer_norm(hidden, (cols,), w.to(x.dtype), lb.to(x.dtype))])

    inputs = [x, b, r, w, lb]
    kernel = _run(fused, inputs, g)
    same = _run(plain, inputs, g)
    exact = _run(plain, [t.double() for t in inputs], g.double())
    _flash_rule(kernel, same, exact, f"bias_dropout_residual_layer_norm {dtype} {cols}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_forward_and_backward_equal_the_cpu_reference(dtype):
    """With dropout on, each fused op's outputs and gradients equal the CPU reference's on the same stream."""
    cases = {
        "softmax": (lambda s: ops.softmax_dropout(s, 0.5, causal=True, p=0.2, seed=5), [(2, 3, 16, 64)]),
        "softmax wide": (lambda s: ops.softmax_dropout(s, 0.5, p=0.2, seed=5), [(1, 2, 3, 3000)]),
        "bias dropout residual": (
            lambda x, b, r: ops.bias_dropout_residual(x, b, r, p=0.3, seed=6),
            [(4, 9, 256), (256,), (4, 9, 256)],
        ),
        "bias dropout residual layer norm": (
            lambda x, b, r, w, lb: torch.stack(ops.bias_dropout_residual_layer_norm(x, b, r, w, lb, p=0.3, seed=7)),
            [(4, 9, 256), (256,), (4, 9, 256), (256,), (256,)],
        ),
    }
    for name, (fn, shapes) in cases.items():
        inputs = [torch.randn(s, device="cuda").to(dtype if len(s) > 1 else torch.float32) for s in shapes]
        g = torch.randn(fn(*inputs).shape, device="cuda")
        on_gpu = _run(fn, inputs, g)
        on_cpu = _run(fn, [t.cpu() for t in inputs], g.cpu())
        for got, want in zip(on_gpu, on_cpu):
            assert torch.equal(got.cpu() == 0, want == 0) or got.dim() == 1, f"{name}: other elements dropped"
            tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
            torch.testing.assert_close(got.cpu().float(), want.float(), rtol=tol, atol=tol, msg=name)


def test_fused_block_backward_on_gpu():
    cfg = dict(vocab_size=64, block_size=128, n_layer=2, n_head=4, n_embd=256)
    check_fused_gpt(cfg, 4, "cuda", out_tol=1e-4, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n", "block"), [(1, 1_000_003, 256), (4, 3001, 64)])
def test_quantize_kernels_equal_the_cpu_reference(dtype, rows, n, block):
    """ZeRO++'s int8 blocks (cuda_kernels/quantize.cu) bit for bit the torch reference on the CPU."""
    x = (torch.randn(rows, n) * torch.logspace(-3, 2, n)).to(dtype)
    values, scales = launchers.quantize_blocks(x.cuda(), block)
    want_values, want_scales = reference.quantize_blocks(x, block)
    assert torch.equal(values.cpu(), want_values) and torch.equal(scales.cpu(), want_scales)
    out = torch.full((rows, n), float("nan"), dtype=dtype, device="cuda")
    launchers.dequantize_blocks(out, values, scales, block)
    want = torch.empty(rows, n, dtype=dtype)
    reference.dequantize_blocks(want, want_values, want_scales, block)
    assert torch.equal(out.cpu(), want)
