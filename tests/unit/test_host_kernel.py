"""The host AdamW kernel (kernels/host.py over cpu_kernels/adamw.c), what offloaded units step with.

- One step equals the pure-torch reference (torch.optim.AdamW's update) within float rounding, for both
  of torch's lerp forms (1 - beta1 below and above 0.5), with a gradient multiplier; several steps equal
  torch.optim.AdamW itself.
- The 16-bit copy written in the same pass is exactly the updated fp32 value cast by torch (fp16 and bf16:
  round to nearest even, ties, overflow to inf, nan).
- Misaligned views (ZeRO's pieces start anywhere), many runs in one call, and any thread count give the
  same bits as one thread over one run at a time.
- Bad inputs are refused with the name of the bad one; the build is cached by source and compiler;
  ``LIGHTNING_ZERO_HOST_KERNELS=0`` turns it off.
"""

from __future__ import annotations

import pytest
import torch

from lightning_zero.kernels import host, reference
from lightning_zero.kernels.adamw import AdamWRun

pytestmark = pytest.mark.skipif(not host.available(), reason="no C compiler to build the host kernel")

HYPER = {"lr": 1e-3, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


def _state(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g), torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1,
            torch.rand(n, generator=g) * 1e-2]  # fmt: skip


@pytest.mark.parametrize("beta1", [0.9, 0.3])
def test_one_step_equals_the_reference(beta1):
    param, grad, exp_avg, exp_avg_sq = _state(100_003)
    expected = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
    kwargs = {**HYPER, "beta1": beta1, "step": 7}
    host.adamw_step([AdamWRun(param, grad, exp_avg, exp_avg_sq, grad_mul=0.25, **kwargs)])
    reference.adamw_(*expected[:1], grad, *expected[1:], inv_scale=0.25, **kwargs)
    for got, want in zip((param, exp_avg, exp_avg_sq), expected):
        # rounding of the operands (torch's lerp may fuse a multiply-add; ours never does): near-zero moments
        # differ by an ulp of the values they were computed from
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


def test_steps_equal_torch_adamw():
    param, grad, _, _ = _state(4099)
    theirs = torch.nn.Parameter(param.clone())
    optimizer = torch.optim.AdamW([theirs], lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-6)
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    for step in range(1, 21):
        g = torch.sin(grad * step)
        theirs.grad = g
        optimizer.step()
        run = AdamWRun(param, g, exp_avg, exp_avg_sq, lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6,
                           weight_decay=0.1, step=step)  # fmt: skip
        host.adamw_step([run])
    torch.testing.assert_close(param, theirs.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_16_bit_copy_is_torch_s_cast_of_the_update(dtype):
    param, grad, exp_avg, exp_avg_sq = _state(50_000)
    # values that round to ties, overflow fp16 and are nan: lr 0 and no decay leave them unchanged
    specials = torch.tensor(
        [1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-11, 65520.0, -1e6, 3e38, float("inf"), float("nan")]
    )
    param[: len(specials)] = specials
    out = torch.empty(param.shape, dtype=dtype)
    run = AdamWRun(param, grad, exp_avg, exp_avg_sq, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8,
                       weight_decay=0.0, step=1, lowp_out=out)  # fmt: skip
    host.adamw_step([run])
    assert torch.equal(param[: len(specials)].nan_to_num(0.5), specials.nan_to_num(0.5))
    _assert_same_bits(out, param.to(dtype))
    run.lr = 1e-2
    host.adamw_step([run])
    _assert_same_bits(out, param.to(dtype))


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bitwise equal, signs of zeros and infinities included; a nan only as a nan (torch's own casts give
    bf16 nans different bits on its scalar and vector paths)."""
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.view(torch.int16)[~got.isnan()], want.view(torch.int16)[~want.isnan()])


def test_views_runs_and_threads_give_the_same_bits():
    flat = _state(3 * 10_007 + 5, seed=3)
    bounds = [(1, 9_000), (9_000, 9_003), (9_003, 30_026)]  # starts off every 16-byte boundary
    expected = [t.clone() for t in flat]
    for lo, hi in bounds:  # one run at a time on one thread
        p, g, m, v = (t[lo:hi] for t in expected)
        host.adamw_step([AdamWRun(p, g, m, v, beta1=0.9, step=3, **HYPER)], threads=1)
    for threads in (2, 3, 7):
        state = [t.clone() for t in flat]
        runs = [AdamWRun(*(t[lo:hi] for t in state), beta1=0.9, step=3, **HYPER) for lo, hi in bounds]
        host.adamw_step(runs, threads=threads)
        assert all(torch.equal(a, b) for a, b in zip(state, expected)), threads


def test_bad_inputs_name_the_tensor():
    param, grad, exp_avg, exp_avg_sq = _state(64)
    with pytest.raises(ValueError, match="grad must be a contiguous CPU tensor of 64 elements"):
        host.task(AdamWRun(param, grad[:32], exp_avg, exp_avg_sq, beta1=0.9, step=1, **HYPER))
    with pytest.raises(ValueError, match="exp_avg_sq must be .* in torch.float32, got .* torch.float64"):
        host.task(AdamWRun(param, grad, exp_avg, exp_avg_sq.double(), beta1=0.9, step=1, **HYPER))
    with pytest.raises(ValueError, match="param must be a contiguous"):
        host.task(AdamWRun(param.view(8, 8).t(), grad, exp_avg, exp_avg_sq, beta1=0.9, step=1, **HYPER))
    lowp = torch.empty(64, dtype=torch.float32)
    with pytest.raises(ValueError, match="lowp_out must be .* torch.float16 or torch.bfloat16"):
        host.task(AdamWRun(param, grad, exp_avg, exp_avg_sq, beta1=0.9, step=1, lowp_out=lowp, **HYPER))


def test_the_build_is_cached_and_can_be_turned_off(tmp_path, monkeypatch):
    first = host.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert host.build(tmp_path) == first and first.stat().st_mtime_ns == stamp  # loaded, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no partial files left
    monkeypatch.setenv("LIGHTNING_ZERO_HOST_KERNELS", "0")  # read once per process: as a fresh one would
    host._library.cache_clear()
    try:
        assert not host.available()
    finally:
        host._library.cache_clear()
