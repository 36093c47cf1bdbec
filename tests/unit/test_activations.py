"""Activation checkpointing and its host offload in one process (activations/), and the activation estimate
(planning/activations.py): memory measured with torch's own tracker (``MemTracker``, in bytes) for a GPT at a long
sequence, the estimate against those measurements, the host pool's reuse, the hooks' removal and the refusals."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from lightning_zero.activations.checkpointing import UnitCheckpoints, checkpoint_units, checkpointed_blocks
from lightning_zero.activations.host_offload import HostActivations
from lightning_zero.config import ZeroConfig
from lightning_zero.models.gpt import GPT, GPTConfig
from lightning_zero.planning.activations import ActivationProfile, longest_fitting, profile_activations
from tests.support.helpers import run_cli

# 16 blocks at 256 tokens: the blocks' activations dominate, as in a long-sequence run
LONG = GPTConfig(vocab_size=64, block_size=256, n_layer=16, n_head=4, n_embd=64)


def _train(mode: str, offload: bool, steps: int = 2) -> tuple[int, list[torch.Tensor], HostActivations | None]:
    """Peak activation bytes of the last step: what MemTracker holds at the peak besides parameters and their
    gradients (made before, so they do not move the peak), saved tensors and backward's temporaries, outside the host
    pool (counted among them once the step touches its one buffer); and the gradients the step leaves."""
    torch.manual_seed(0)
    model = GPT(LONG)
    pool = HostActivations(torch.device("cpu")) if offload else None
    if mode != "none":
        UnitCheckpoints(list(model.blocks), selective=mode == "selective", offload=pool)
    tokens = torch.randint(64, (1, LONG.block_size), generator=torch.Generator().manual_seed(1))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for step in range(steps):  # (the last step, tracked, finds the pool made: no allocation in it)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker if step == steps - 1 else contextlib.nullcontext():
            logits = model(tokens)
            F.cross_entropy(logits.view(-1, 64), tokens.view(-1)).backward()
        del logits
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    activations = sum(v for k, v in peak.items() if str(k).endswith(("ACT", "TEMP")))
    activations -= pool.pool.capacity if pool else 0
    return activations, [p.grad for p in model.parameters()], pool


def _profile() -> ActivationProfile:
    with torch.device("meta"):
        model = GPT(LONG)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        tokens = torch.zeros(1, LONG.block_size, dtype=torch.long)
        return profile_activations(model, list(model.blocks), lambda: model(tokens))


def test_checkpointing_cuts_activations_offload_moves_them_and_the_estimate_predicts_them():
    plain, grads, _ = _train("none", False)
    profile = _profile()
    measured = {}
    for mode, offload in (("units", False), ("selective", False), ("units", True)):
        measured[mode, offload], mode_grads, pool = _train(mode, offload)
        assert all(torch.equal(a, b) for a, b in zip(mode_grads, grads)), (mode, offload)  # exactly the same
        if pool is not None:  # one buffer of every block's input, reused: nothing held after the backward
            assert pool.pool.capacity == 16 * LONG.block_size * LONG.n_embd * 4 and pool.pool.live == 0
    assert measured["units", False] <= 0.25 * plain, (measured, plain)
    assert measured["units", True] <= 0.10 * plain, (measured, plain)
    assert measured["units", True] < measured["selective", False] < plain
    for (mode, offload), value in [(("none", False), plain), *measured.items()]:
        predicted = profile.held(mode, offload=offload)[0]
        assert abs(predicted - value) <= 0.10 * value, (mode, offload, predicted, value)


def test_the_host_pool_is_one_buffer_reused_and_grows_only_for_a_longer_step():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=64, n_layer=3, n_head=2, n_embd=16))
    offload = HostActivations(torch.device("cpu"))
    UnitCheckpoints(list(model.blocks), selective=False, offload=offload)
    chunks = []
    for length in (32, 32, 32, 64, 64, 64):
        model(torch.zeros(2, length, dtype=torch.long)).sum().backward()
        assert offload.pool.live == 0  # (every saved input released with the backward)
        chunks.append([c.buffer.data_ptr() for c in offload.pool._chunks])
    assert chunks[1] == chunks[2] and len(chunks[1]) == 1  # the first step's three inputs in one buffer, reused
    assert chunks[4] == chunks[5] and len(chunks[4]) == 1  # a longer step: one larger buffer, reused from then on
    assert offload.pool.capacity == 3 * 2 * 64 * 16 * 4 == offload.pool.peak_bytes
    kept = model(torch.zeros(2, 64, dtype=torch.long))  # a graph kept alive (never backpropagated)
    for _ in range(4):  # the next steps reuse one chunk, not a new one each
        model(torch.zeros(2, 64, dtype=torch.long)).sum().backward()
    assert offload.pool.capacity <= 3 * offload.pool.peak_bytes and offload.pool.live == 3
    del kept


def test_removed_hooks_leave_the_model_as_it_was():
    model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16))
    calls = []
    model.blocks[0].register_forward_pre_hook(lambda *_: calls.append(1))
    checkpoints = checkpoint_units(model, ZeroConfig(activation_checkpointing="units"), torch.device("cpu"))
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    assert len(calls) == 2  # the forward, and its recomputation in backward
    checkpoints.remove()
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    assert len(calls) == 3 and checkpoint_units(model, ZeroConfig(), torch.device("cpu")) is None


def test_a_model_without_blocks_and_hugging_face_checkpointing_are_refused():
    config = ZeroConfig(activation_checkpointing="selective")
    with pytest.raises(ValueError, match="'selective', but the model has no blocks to checkpoint"):
        checkpointed_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)), config)
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1)
    )  # fmt: skip
    assert len(checkpointed_blocks(llama, config)) == 2  # (its decoder layers)
    llama.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(ValueError, match=r"own \(Hugging Face\) gradient checkpointing is on: choose one"):
        checkpointed_blocks(llama, config)


def test_blocks_compiled_one_by_one_are_checkpointed_and_a_model_compiled_around_them_is_refused():
    def train(mode: str, offload: str = "none") -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.2))
        for i, block in enumerate(model.blocks):  # (AOTAutograd's graphs save their tensors as compiled ones do)
            model.blocks[i] = torch.compile(block, backend="aot_eager")
        config = ZeroConfig(activation_checkpointing=mode, offload_activations=offload)
        checkpoint_units(model, config, torch.device("cpu"))
        torch.manual_seed(1)
        for _ in range(2):
            model(torch.zeros(2, 16, dtype=torch.long)).square().mean().backward()
        return [p.grad for p in model.parameters()]

    plain = train("none")
    for mode, offload in (("units", "none"), ("selective", "cpu")):
        assert all(torch.equal(a, b) for a, b in zip(train(mode, offload), plain)), (mode, offload)
    model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16))
    model.compile()
    with pytest.raises(ValueError, match="compiled around its blocks .* compile the blocks one by one"):
        checkpointed_blocks(model, ZeroConfig(activation_checkpointing="units"))


class KeywordBlocks(torch.nn.Module):
    """Blocks called with keyword arguments only, with dropout, and a hook before ours that changes their input."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.3), torch.nn.Tanh()) for _ in range(3)
        )
        self.blocks[1].register_forward_pre_hook(lambda module, args, kwargs: (args, {"input": 2 * kwargs["input"]}),
                                                 with_kwargs=True)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(input=x)
        return x


def _keyword_grads(mode: str, offload: str, backwards: int = 1) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = KeywordBlocks()
    checkpoints = checkpoint_units(model, ZeroConfig(activation_checkpointing=mode, offload_activations=offload),
                                   torch.device("cpu"))  # fmt: skip
    torch.manual_seed(1)
    loss = model(torch.randn(4, 8)).square().sum()
    for k in range(backwards):  # (a graph kept for a second backward recomputes again)
        loss.backward(retain_graph=k < backwards - 1)
    if offload == "cpu":
        assert checkpoints.offload.pool.peak_bytes == 3 * 4 * 8 * 4  # (the keyword inputs, offloaded)
    return [p.grad for p in model.parameters()]


def test_keyword_inputs_earlier_hooks_and_a_second_backward_are_checkpointed_exactly():
    plain = _keyword_grads("none", "none")
    for mode, offload in (("units", "none"), ("units", "cpu"), ("selective", "none")):
        assert all(torch.equal(a, b) for a, b in zip(_keyword_grads(mode, offload), plain)), (mode, offload)
    twice = _keyword_grads("none", "none", backwards=2)
    assert all(torch.equal(a, b) for a, b in zip(_keyword_grads("units", "cpu", backwards=2), twice))


def test_an_offloaded_input_changed_in_place_raises_as_autograd_does():
    model = KeywordBlocks()
    checkpoint_units(
        model, ZeroConfig(activation_checkpointing="units", offload_activations="cpu"), torch.device("cpu")
    )
    x = torch.randn(4, 8, requires_grad=True)
    h = x * 1.0
    out = model.blocks[0](input=h)
    h.add_(1.0)  # (the block's saved input, changed)
    with pytest.raises(RuntimeError, match="modified by an inplace operation: a block's input kept in host memory"):
        out.sum().backward()


def test_only_a_hugging_face_cache_is_dropped():
    class Notebook:  # has get_seq_length and update, and is not a transformers Cache
        def get_seq_length(self) -> int:
            return 0

        def update(self, *args) -> None:
            pass

    transformers = pytest.importorskip("transformers")
    seen = []

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)

        def forward(self, x, notebook=None, past_key_values=None, use_cache=False):
            seen.append((notebook, past_key_values, use_cache))
            return self.linear(x)

    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([Block()])
    checkpoint_units(model, ZeroConfig(activation_checkpointing="units"), torch.device("cpu"))
    notebook, cache = Notebook(), transformers.DynamicCache()
    model.blocks[0](torch.ones(1, 2), notebook=notebook, past_key_values=cache, use_cache=True).sum().backward()
    assert seen[0] == (notebook, None, False) and seen[1] == seen[0]  # (the forward, and its recomputation)
    model.eval()  # (not training: a cache is the caller's)
    model.blocks[0](torch.ones(1, 2), notebook=notebook, past_key_values=cache, use_cache=True)
    assert seen[2] == (notebook, cache, True)


def test_the_longest_fitting_sequence_is_found_exactly():
    def linear(seq_len: int) -> ActivationProfile:  # per token: 5 bytes after the blocks; per block 100, input 10
        return ActivationProfile(0, 5 * seq_len, [100 * seq_len] * 4, [10 * seq_len] * 4, [0] * 4, [0] * 4)

    budget = 1_000_000  # (+ 10 per token: the gradient of a block's input while its backward runs)
    assert longest_fitting(linear, budget, "none", False) == budget // (5 + 400 + 10)
    assert longest_fitting(linear, budget, "units", False) == budget // (30 + 100 + 10)  # the last block recomputed
    assert longest_fitting(linear, budget, "units", True) == budget // (2 * 10 + 90 + 10)  # its input and the next
    assert longest_fitting(linear, 10, "none", False) == 0


def test_estimate_counts_activations_and_names_the_longest_sequence(capsys):
    code, out, _ = run_cli(
        capsys, "estimate", "--model", "configs/gpt.yaml", "--seq-len", "2048", "--device-memory", "2GB"
    )
    assert code == 0
    first = out.split("activations per rank at 2048 tokens")[1].split("the longest sequence")[0]
    rows = {line.split()[0]: line.split()[1:] for line in first.splitlines()[2:] if line.strip()}
    assert float(rows["units"][0]) < 0.4 * float(rows["none"][0])  # device GiB
    assert float(rows["units+offload"][1]) > 0 == float(rows["units"][1])  # host GiB: the pool
    assert "the longest sequence (tokens per sample) fitting 2GB per device" in out
    longest = out.split("fitting 2GB")[1].splitlines()
    units = next(line for line in longest if line.startswith("units ")).split()[1:]
    none = next(line for line in longest if line.startswith("none ")).split()[1:]
    assert all(int(u.replace(",", "")) >= 2 * int(n.replace(",", "")) for u, n in zip(units, none))  # (4 blocks)
