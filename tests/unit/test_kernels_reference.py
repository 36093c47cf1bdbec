"""The pure-torch references of the fused kernels (the CPU fallback and the GPU tests' oracle) against
torch's own ops, gradients included; the Philox stream against Random123's known answers; FusedAdamW
against torch.optim.AdamW; the fused GPT block against the plain one."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_zero.kernels import adamw as fused_adamw_module
from lightning_zero.kernels import loader, ops, reference
from lightning_zero.kernels.adamw import FusedAdamW, check_finite_, fused_adamw_
from tests.support.fused_checks import check_fused_adamw_under_grad_scaler, check_fused_gpt


def _words(*values):
    return tuple(torch.tensor([v]) for v in values)


@pytest.mark.parametrize(
    "counter,key,expected",
    [  # Random123's known-answer tests for philox4x32_10
        ((0, 0, 0, 0), (0, 0), "6627e8d5 e169c58d bc57ac4c 9b00dbd8"),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, "408f276d 41c83b0e a20bc7c6 6d5451fd"),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            "d16cfe09 94fdcceb 5001e420 24126ea1",
        ),
    ],
)
def test_philox_matches_random123(counter, key, expected):
    assert " ".join(f"{int(w):08x}" for w in reference.philox4x32(_words(*counter), key)) == expected


def test_one_philox_call_gives_four_consecutive_elements():
    seed, offset = 0x1234_5678_9ABC, 7
    key = (seed & 0xFFFFFFFF, seed >> 32)
    for group in (0, 5, 2**33 + 1):  # torch's counter layout: (offset // 4 + group, subsequence 0)
        count = offset // 4 + group
        words = reference.philox4x32(_words(count & 0xFFFFFFFF, count >> 32, 0, 0), key)
        expected = torch.cat([(w >> 8).float() / 16777216.0 for w in words])
        got = reference.philox_uniform(seed, offset, torch.arange(4 * group, 4 * group + 4))
        assert torch.equal(got, expected), group


def test_dropout_is_reproducible_with_the_right_keep_rate():
    x = torch.ones(200, 1000)
    a = reference.dropout(x, 0.3, seed=7, offset=0)
    assert torch.equal(a, reference.dropout(x, 0.3, seed=7, offset=0))
    assert not torch.equal(a, reference.dropout(x, 0.3, seed=7, offset=4))  # offsets count 4 elements each
    assert not torch.equal(a, reference.dropout(x, 0.3, seed=8, offset=0))
    kept = (a != 0).float().mean()
    assert abs(float(kept) - 0.7) < 0.005  # 200k draws: 5 sigma is 0.005
    assert torch.allclose(a[a != 0], torch.full_like(a[a != 0], 1 / 0.7))


def _grads(fn, *inputs):
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*inputs)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return out.detach(), [t.grad for t in inputs if t.requires_grad]


def _assert_same(a, b, tol=1e-6):
    (out_a, grads_a), (out_b, grads_b) = a, b
    torch.testing.assert_close(out_a, out_b, rtol=tol, atol=tol)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb, rtol=tol, atol=tol)


@pytest.mark.parametrize("shape", [(3, 5, 1023), (7, 64)])
def test_layer_norm_reference(shape):
    x, w, b = torch.randn(shape), torch.randn(shape[-1]), torch.randn(shape[-1])
    module = torch.nn.LayerNorm(shape[-1])
    torch_ln = lambda x, w, b: torch.func.functional_call(module, {"weight": w, "bias": b}, (x,))  # noqa: E731
    _assert_same(_grads(ops.layer_norm, x, w, b), _grads(torch_ln, x, w, b))


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_bias_gelu_reference(approximate):
    x, b = torch.randn(4, 9, 997), torch.randn(997)
    gelu = torch.nn.GELU(approximate=approximate)
    ours, torchs = _grads(lambda x, b: ops.bias_gelu(x, b, approximate), x, b), _grads(lambda x, b: gelu(x + b), x, b)
    # the reference's own backward: the bias gradient sums 36 rows in another order than autograd's
    _assert_same(ours, torchs, tol=1e-5)


def test_causal_softmax_reference():
    scores = torch.randn(2, 3, 17, 17)
    hidden = torch.ones(17, 17, dtype=torch.bool).triu(1)
    expected = lambda s: torch.softmax((s * 0.25).masked_fill(hidden, float("-inf")), dim=-1)  # noqa: E731
    _assert_same(_grads(lambda s: ops.softmax_dropout(s, 0.25, causal=True), scores), _grads(expected, scores))


def test_masked_softmax_reference_and_fully_masked_rows():
    scores, mask = torch.randn(2, 3, 5, 11), torch.zeros(2, 1, 5, 11)
    mask[0, 0, 1] = float("-inf")  # every key hidden for one query of batch 0
    mask[1, 0, :, 4:] = -1e4
    out, (grad,) = _grads(lambda s: ops.softmax_dropout(s, 1.0, mask=mask), scores)
    assert torch.equal(out[0, :, 1], torch.zeros(3, 11)) and torch.isfinite(grad).all()
    torch.testing.assert_close(out[1], torch.softmax(scores[1] + mask[1], dim=-1))


def test_bool_per_head_and_padding_masks_mean_what_sdpa_means():
    """A bool mask keeps True (as scaled_dot_product_attention does); masks broadcast from any shape."""
    q = k = v = torch.randn(2, 3, 5, 4)
    scores = q @ k.transpose(-1, -2)
    for mask in (
        torch.rand(2, 1, 5, 5) > 0.3,  # per batch, shared by the heads
        torch.rand(1, 3, 5, 5) > 0.3,  # per head
        torch.tensor([[True] * 4 + [False], [True] * 5]).view(2, 1, 1, 5),  # padding: (batch, 1, 1, keys)
        torch.randn(5, 5),  # additive, (q_len, k_len)
    ):
        mask = mask | torch.eye(5, dtype=torch.bool) if mask.dtype == torch.bool else mask  # no row fully hidden
        ours = ops.softmax_dropout(scores, 0.5, mask=mask) @ v
        torch.testing.assert_close(ours, torch.nn.functional.scaled_dot_product_attention(q, k, v, mask, scale=0.5))


def test_without_a_seed_each_call_drops_anew_and_manual_seed_governs_it():
    x, b, r = torch.randn(64, 32), torch.zeros(32), torch.zeros(64, 32)
    torch.manual_seed(5)
    first, second = (ops.bias_dropout_residual(x, b, r, p=0.5) for _ in range(2))
    assert not torch.equal(first == 0, second == 0)  # no fixed default stream
    torch.manual_seed(5)
    assert torch.equal(ops.bias_dropout_residual(x, b, r, p=0.5), first)
    scores = torch.randn(1, 2, 8, 8)
    torch.manual_seed(5)
    assert not torch.equal(ops.softmax_dropout(scores, 1.0, p=0.5), ops.softmax_dropout(scores, 1.0, p=0.5))


def test_softmax_dropout_reference_drops_with_the_philox_stream():
    scores = torch.randn(2, 2, 8, 8)
    out = ops.softmax_dropout(scores, 1.0, p=0.5, seed=3, offset=2)
    expected = reference.dropout(torch.softmax(scores, dim=-1), 0.5, seed=3, offset=2)
    torch.testing.assert_close(out, expected)


def test_bias_dropout_residual_reference():
    x, b, r = torch.randn(4, 33), torch.randn(33), torch.randn(4, 33)
    _assert_same(
        _grads(lambda x, b, r: ops.bias_dropout_residual(x, b, r), x, b, r), _grads(lambda x, b, r: x + b + r, x, b, r)
    )
    dropped = ops.bias_dropout_residual(x, b, r, p=0.25, seed=11)
    torch.testing.assert_close(dropped, r + reference.dropout(x + b, 0.25, seed=11, offset=0))


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_bias_dropout_residual_layer_norm_reference(p):
    """Both outputs (the residual stream and its LayerNorm) and all five gradients, against torch's own ops on
    the same dropout mask, with gradients arriving at both outputs."""
    import torch.nn.functional as F

    x, b, r, w, lb = torch.randn(3, 4, 40), torch.randn(40), torch.randn(3, 4, 40), torch.randn(40), torch.randn(40)
    keep = reference._keep(x.shape, p, 21, 8, x.device).float() / (1 - p) if p > 0 else 1.0

    def fused(x, b, r, w, lb):
        hidden, normed = ops.bias_dropout_residual_layer_norm(x, b, r, w, lb, p=p, seed=21, offset=8)
        return torch.cat([hidden, normed * 2])

    def plain(x, b, r, w, lb):
        hidden = r + (x + b) * keep
        return torch.cat([hidden, F.layer_norm(hidden, (40,), w, lb) * 2])

    _assert_same(_grads(fused, x, b, r, w, lb), _grads(plain, x, b, r, w, lb), tol=1e-5)


def test_fused_adamw_matches_torch_adamw_over_ten_steps():
    torch.manual_seed(0)
    params = [torch.randn(1023), torch.randn(64, 17)]
    mine, theirs = [p.clone() for p in params], [p.clone() for p in params]
    opt_mine = FusedAdamW([{"params": mine[:1], "weight_decay": 0.1}, {"params": mine[1:], "lr": 3e-3}], lr=1e-2)
    opt_theirs = torch.optim.AdamW(
        [{"params": theirs[:1], "weight_decay": 0.1}, {"params": theirs[1:], "lr": 3e-3}], lr=1e-2
    )
    for _ in range(10):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(mine + theirs, grads + grads):
            p.grad = g.clone()
        opt_mine.step()
        opt_theirs.step()
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert set(opt_mine.state[mine[0]]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("unscale_in_step", [True, False])
def test_fused_adamw_under_a_grad_scaler_skips_overflowed_steps(unscale_in_step):
    check_fused_adamw_under_grad_scaler("cpu", unscale_in_step=unscale_in_step)


def test_fused_adamw_step_counts_from_numbers_fp64_and_scaler_steps_between_plain_ones():
    """Counts as old checkpoints may hold them (a number, fp64), then GradScaler steps (counts move to the
    device's side), then plain steps again: torch.optim.AdamW's parameters throughout, counts in fp32."""
    torch.manual_seed(0)
    mine = [torch.randn(50, requires_grad=True) for _ in range(2)]
    theirs = [p.detach().clone().requires_grad_() for p in mine]
    opts = FusedAdamW(mine, lr=1e-2), torch.optim.AdamW(theirs, lr=1e-2)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1) for _ in range(2)]
    for step in range(5):
        if step == 2:
            opts[0].state[mine[0]]["step"] = 2
            opts[0].state[mine[1]]["step"] = torch.tensor(2.0, dtype=torch.float64)
        grads = [torch.randn(50) for _ in mine]
        for params, opt, scaler in zip((mine, theirs), opts, scalers):
            opt.zero_grad()
            loss = sum((p * g).sum() for p, g in zip(params, grads))  # each parameter's gradient: its g
            if step in (2, 3):
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for p in mine:
        count = opts[0].state[p]["step"]
        assert count.dtype == torch.float32 and count.item() == 5.0


def test_fused_adamw_unscales_skips_on_overflow_and_writes_low_precision():
    param, grad = torch.randn(100), torch.randn(100)
    m, v = torch.zeros(100), torch.zeros(100)
    expected = param.clone()
    reference.adamw_(
        expected, grad, m.clone(), v.clone(), lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1
    )
    found_inf, lowp = torch.zeros(1, dtype=torch.int32), torch.empty(100, dtype=torch.bfloat16)
    check_finite_(grad * 1024, found_inf)
    assert int(found_inf) == 0
    fused_adamw_(
        param,
        (grad * 1024).half(),
        m,
        v,
        lr=0.1,
        beta1=0.9,
        beta2=0.99,
        eps=1e-8,
        weight_decay=0.0,
        step=1,
        inv_scale=1 / 1024,
        found_inf=found_inf,
        lowp_out=lowp,
    )
    torch.testing.assert_close(param, expected, rtol=1e-3, atol=1e-3)  # the fp16 gradient's rounding
    assert torch.equal(lowp, param.bfloat16())
    before = param.clone()
    check_finite_(torch.tensor([1.0, float("inf")]), found_inf)
    assert int(found_inf) == 1
    fused_adamw_(
        param, grad, m, v, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=2, found_inf=found_inf
    )
    assert torch.equal(param, before)


@pytest.mark.parametrize("bias", [True, False])
def test_fused_block_equals_block(bias):
    cfg = dict(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=64, bias=bias)
    check_fused_gpt(cfg, 3, out_tol=1e-5, rtol=1e-5, atol=1e-6)


def test_without_a_gpu_the_ops_fall_back_and_say_so_once(caplog):
    loader.available.cache_clear()
    with caplog.at_level(logging.INFO, logger="lightning_zero.kernels"):
        for _ in range(3):
            ops.layer_norm(torch.randn(2, 4), torch.ones(4), torch.zeros(4))
    messages = [r.getMessage() for r in caplog.records if "pure-torch" in r.getMessage()]
    assert len(messages) == 1 and "no CUDA device" in messages[0]


def test_kernel_arguments_are_checked_with_clear_errors():
    with pytest.raises(ValueError, match="x must be a CUDA tensor, got one on cpu"):
        loader.tensor(torch.zeros(3), "x", dtypes=(torch.float32,))
    with pytest.raises(ValueError, match="dropout p must be in \\[0, 1\\), got 1.0"):
        ops.bias_dropout_residual(torch.zeros(2), torch.zeros(2), torch.zeros(2), p=1.0)
    with pytest.raises(ValueError, match="approximate must be 'tanh' or 'none', got 'fast'"):
        ops.bias_gelu(torch.zeros(2), torch.zeros(2), approximate="fast")
    with pytest.raises(ValueError, match="scores must be \\(batch, heads, q_len, k_len\\), got shape \\(2, 3\\)"):
        ops.softmax_dropout(torch.zeros(2, 3), 1.0)
    x = torch.zeros(4, 6)
    with pytest.raises(ValueError, match=r"bias must have shape \(6,\) \(from x's shape \(4, 6\)\), got \(4,\)"):
        ops.bias_gelu(x, torch.zeros(4))
    with pytest.raises(ValueError, match=r"residual must have shape \(4, 6\) \(from x's shape \(4, 6\)\), got \(6,\)"):
        ops.bias_dropout_residual(x, torch.zeros(6), torch.zeros(6))
    with pytest.raises(ValueError, match=r"weight must have shape \(6,\) .* got \(6, 1\)"):
        ops.layer_norm(x, torch.ones(6, 1), torch.zeros(6))
    with pytest.raises(ValueError, match="weight must be a floating-point tensor, got torch.int64"):
        ops.layer_norm(x, torch.ones(6, dtype=torch.long), torch.zeros(6))
    with pytest.raises(ValueError, match="x must be a float32, float16 or bfloat16 tensor .* got torch.int64"):
        ops.layer_norm(x.long(), torch.ones(6), torch.zeros(6))
    with pytest.raises(ValueError, match=r"mask of shape \(3, 3\) does not broadcast to the scores' \(1, 2, 4, 5\)"):
        ops.softmax_dropout(torch.zeros(1, 2, 4, 5), 1.0, mask=torch.zeros(3, 3))
    with pytest.raises(ValueError, match="mask must be bool .* or floating-point .* got torch.int64"):
        ops.softmax_dropout(torch.zeros(1, 2, 4, 5), 1.0, mask=torch.zeros(4, 5, dtype=torch.long))
    assert fused_adamw_module.LOWP[None] == "none"
