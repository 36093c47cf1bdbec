"""Hugging Face models sequence-parallel (sequence/hf.py) in one process: attaching registers one attention (and
mask) function per model config and points the config at it, undo restores both, and what cannot run so is refused
in one line before anything changes or any collective runs (key/value heads the size does not divide, an
implementation without a mask function, a prepared 4D mask, non-causal attention). The runs themselves are in
tests/dist/test_sequence_hf.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_zero.sequence.hf import PREFIX, attach_ulysses
from lightning_zero.sequence.parallel import SequenceParallel

pytest.importorskip("transformers")
from transformers import AttentionInterface, GPT2Config, GPT2Model, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402


def _group(size: int) -> SequenceParallel:  # (the world's group: nothing here reaches a collective but one check)
    return SequenceParallel(group=None, rank=0, size=size, data_rank=0, data_size=1)


def _llama(kv_heads: int = 4, implementation: str = "sdpa") -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=8,
        num_key_value_heads=kv_heads, max_position_embeddings=16, attn_implementation=implementation,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _ours() -> list[str]:
    return [
        k for registry in (AttentionInterface, AttentionMaskInterface) for k in registry._global_mapping if PREFIX in k
    ]


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_attach_points_each_config_at_its_own_registration_and_undo_restores_it(implementation):
    model = _llama(implementation=implementation)
    holder = torch.nn.ModuleDict({"lm": model, "other": GPT2Model(GPT2Config(n_embd=16, n_layer=1, n_head=4))})
    undo = attach_ulysses(holder, _group(4))
    names = {model.config._attn_implementation, holder["other"].config._attn_implementation}
    assert all(name.startswith(PREFIX) for name in names) and len(names) == 2  # (the LM and its base: one config)
    assert model.model.config._attn_implementation == model.config._attn_implementation
    assert sorted(_ours()) == sorted([*names, *names])  # an attention and a mask function each
    undo()
    assert model.config._attn_implementation == implementation
    assert holder["other"].config._attn_implementation == "sdpa"
    assert _ours() == []
    assert attach_ulysses(holder, None)() is None  # (no group: nothing to do)


@pytest.fixture
def one_process_group():
    """A process group of this process alone (the position check's all-reduce runs on it)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_what_cannot_run_sequence_parallel_is_refused_before_anything_changes(one_process_group):
    with pytest.raises(
        ValueError,
        match=r"sequence_parallel_size 4 must divide the key/value heads, 2 \(the attention repeats them itself\)",
    ):
        attach_ulysses(_llama(kv_heads=2), _group(4))
    with pytest.raises(ValueError, match="sequence_parallel_size 4 must divide the attention heads, 6"):
        attach_ulysses(GPT2Model(GPT2Config(n_embd=24, n_layer=1, n_head=6)), _group(4))
    model = _llama()
    model.config._attn_implementation_internal = "paged|eager"
    with pytest.raises(ValueError, match="runs LlamaForCausalLM's attention as sdpa, eager, flash or flex"):
        attach_ulysses(model, _group(2))
    assert model.config._attn_implementation == "paged|eager" and _ours() == []
    model = _llama()
    undo = attach_ulysses(model, _group(2))
    with pytest.raises(ValueError, match="already runs its attention sequence-parallel"):
        attach_ulysses(model, _group(2))
    ids, positions = torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None]  # (rank 0's slice of 8 tokens)
    with pytest.raises(ValueError, match="every rank passes its slice's global position_ids"):
        model(input_ids=ids, position_ids=positions + 1)  # (or packed sequences, restarting inside)
    with pytest.raises(ValueError, match="cannot from a prepared 4D one: pass the 2D mask's slice"):
        model(input_ids=ids, position_ids=positions, attention_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool))
    model.model.layers[0].self_attn.is_causal = False
    with pytest.raises(ValueError, match="runs causal self-attention only, not LlamaAttention's"):
        model(input_ids=ids, position_ids=positions)
    undo()
