"""Activation checkpointing's host offload on a CUDA GPU (skipped without one; run by benchmarks/gpu_check.sh): the
checkpoints go to a pinned pool on a side stream and come back one block ahead, training bitwise as checkpointing
without offload, with less device memory; the copies run on their own stream, overlapping the compute kernels
(read from a profiler trace), not serialized with them."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from lightning_zero.activations.checkpointing import UnitCheckpoints
from lightning_zero.activations.host_offload import HostActivations
from lightning_zero.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CONFIG = GPTConfig(vocab_size=256, block_size=2048, n_layer=8, n_head=8, n_embd=512)


def _model(offload: bool) -> tuple[GPT, HostActivations | None]:
    torch.manual_seed(0)
    model = GPT(CONFIG).cuda()
    pool = HostActivations(torch.device("cuda")) if offload else None
    UnitCheckpoints(list(model.blocks), selective=False, offload=pool)
    return model, pool


def _step(model: GPT, tokens: torch.Tensor) -> None:
    logits = model(tokens)
    F.cross_entropy(logits.view(-1, logits.size(-1)), tokens.view(-1)).backward()


def test_offloaded_checkpoints_train_the_same_with_less_device_memory():
    tokens = torch.randint(256, (2, CONFIG.block_size), device="cuda")
    peaks, grads = {}, {}
    for offload in (False, True):
        model, pool = _model(offload)
        _step(model, tokens)  # (the pool is made)
        model.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        _step(model, tokens)
        torch.cuda.synchronize()
        peaks[offload] = torch.cuda.max_memory_allocated() - before
        grads[offload] = [p.grad.clone() for p in model.parameters()]
        if pool is not None:
            assert pool.pool._chunks[0].is_pinned() and pool.pool.live == 0
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
    inputs = 2 * CONFIG.block_size * CONFIG.n_embd * 4  # one block's input, fp32
    assert peaks[True] <= peaks[False] - (CONFIG.n_layer - 3) * inputs, peaks


def test_the_copies_run_on_a_side_stream_beside_the_compute(tmp_path):
    model, _ = _model(True)
    tokens = torch.randint(256, (2, CONFIG.block_size), device="cuda")
    _step(model, tokens)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        _step(model, tokens)
        torch.cuda.synchronize()
    profiler.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and ("DtoH" in e["name"] or "HtoD" in e["name"])]
    assert len(copies) >= 2 * (CONFIG.n_layer - 1), len(copies)  # (out in forward, back in backward)
    copy_streams = {e["args"].get("stream") for e in copies}
    compute_streams = {e["args"].get("stream") for e in kernels}
    assert len(copy_streams) == 1 and copy_streams.isdisjoint(compute_streams), (copy_streams, compute_streams)

    def overlaps(a: dict, b: dict) -> bool:
        return a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]

    overlapped = sum(any(overlaps(c, k) for k in kernels) for c in copies)
    assert overlapped >= len(copies) // 2, f"{overlapped} of {len(copies)} copies overlap a compute kernel"
