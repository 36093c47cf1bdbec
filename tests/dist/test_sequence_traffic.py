"""Sequence parallelism's traffic and activations against the planning models, on 2 ranks: the bytes the attention's
all-to-alls cover (``collectives.Traffic``, group role "sequence") in a GPT's forward and backward, per layer, with
each activation checkpointing mode, and in Ulysses attention with grouped-query heads split and repeated, equal
comm_model's ``Ulysses``; and what a real rank saves for backward equals the one-process profile with
``profiled_rank`` standing in for the group (planning/activations.py)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_zero.activations.checkpointing import checkpoint_units
from lightning_zero.config import ZeroConfig
from lightning_zero.models.gpt import GPT, GPTConfig
from lightning_zero.planning.activations import ActivationProfile, profile_activations, profiled_rank
from lightning_zero.planning.comm_model import Ulysses
from lightning_zero.sequence.parallel import sequence_parallel
from lightning_zero.sequence.ulysses import ulysses_attention
from lightning_zero.sharding import collectives

CONFIG = GPTConfig(vocab_size=16, block_size=32, n_layer=2, n_head=4, n_embd=32)
B, S, K = 2, 32, 2
MODES = ("none", "units", "selective")
GQA = [(4, 2), (4, 1)]  # (query heads, key/value heads): split over the 2 ranks, and repeated to one per rank


def _tokens() -> torch.Tensor:
    return torch.randint(CONFIG.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))


def _sequence_bytes(traffic: collectives.Traffic, first_forward: bool = False) -> int:
    groups = dict(traffic.bytes_by_group)
    if first_forward:  # a GPT's first input is compared over the group once (check_sliced): an all-gather of it
        assert groups.pop(("sequence", "all_gather")) == K * B * (S // K) * 8
    assert set(groups) == {("sequence", "all_to_all")}
    return groups["sequence", "all_to_all"]


def _worker(rank: int, world: int) -> dict:
    sequence = sequence_parallel(world)
    x = sequence.split(_tokens())
    out: dict = {}
    for mode in MODES:
        torch.manual_seed(0)
        model = GPT(CONFIG, sequence=sequence)
        checkpoint_units(model, ZeroConfig(activation_checkpointing=mode), torch.device("cpu"))
        with collectives.observing(traffic := collectives.Traffic()):
            F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        out[mode] = _sequence_bytes(traffic, first_forward=True)
    for heads, kv_heads in GQA:
        q = torch.randn(B, heads, S // world, 8, requires_grad=True)
        k, v = (torch.randn(B, kv_heads, S // world, 8, requires_grad=True) for _ in range(2))
        with collectives.observing(traffic := collectives.Traffic()):
            y = ulysses_attention(q, k, v, F.scaled_dot_product_attention, group=sequence.group, enable_gqa=True)
            y.sum().backward()
        out[heads, kv_heads] = _sequence_bytes(traffic)
    model = GPT(CONFIG, sequence=sequence)
    out["profile"] = profile_activations(model, list(model.blocks), lambda: model(x))
    return out


def _stand_in_profile() -> ActivationProfile:
    with torch.device("meta"):
        model = GPT(CONFIG, sequence=profiled_rank(K))
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        tokens = torch.zeros(B, S // K, dtype=torch.long)
        return profile_activations(model, list(model.blocks), lambda: model(tokens))


def test_all_to_all_bytes_and_activations_per_rank_equal_the_models(ranks):
    heads = CONFIG.n_head
    gpt = Ulysses(B, S, heads, heads, CONFIG.n_embd // heads, K, 4, layers=CONFIG.n_layer)
    expected = _stand_in_profile()
    for rank, result in enumerate(ranks(_worker, K)):
        for mode in MODES:
            per_layer = result[mode] / CONFIG.n_layer
            assert per_layer == dataclasses.replace(gpt, checkpointing=mode).layer_bytes(), (rank, mode)
        for heads, kv_heads in GQA:
            assert result[heads, kv_heads] == Ulysses(B, S, heads, kv_heads, 8, K).layer_bytes(), (rank, kv_heads)
        assert result["profile"] == expected, rank
