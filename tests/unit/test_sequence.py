"""Sequence parallelism in one process (sequence/): a rank's slice and positions, and the refusals every rank of a
group makes alike before any all-to-all (a sequence longer than the model's positions, heads that do not split,
fused blocks). The collectives themselves run in tests/dist/test_sequence_parallel.py."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.models.gpt import GPT, GPTConfig
from lightning_zero.sequence.parallel import SequenceParallel


def _rank(rank: int, size: int = 2) -> SequenceParallel:
    return SequenceParallel(group=None, rank=rank, size=size, data_rank=0, data_size=1)


def test_a_rank_holds_its_slice_at_its_positions():
    tokens = torch.arange(24).view(2, 12)
    for rank in range(3):
        part = _rank(rank, 3)
        assert torch.equal(part.split(tokens), tokens[:, 4 * rank : 4 * rank + 4])
        assert torch.equal(part.positions(4), torch.arange(4 * rank, 4 * rank + 4))
    assert _rank(1).sampler_kwargs() == {"num_replicas": 1, "rank": 0}
    with pytest.raises(ValueError, match="a sequence of 12 tokens does not split into sequence_parallel_size 5"):
        _rank(0, 5).split(tokens)


def test_the_gpt_refuses_what_the_group_cannot_run_on_every_rank_alike():
    config = GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8)
    model = GPT(config, sequence=_rank(0))  # (rank 0's positions fit; the whole sequence does not)
    with pytest.raises(
        ValueError, match="a slice of 6 tokens on each of 2 .* a sequence of 12, longer than model.block_"
    ):
        model(torch.zeros(1, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="sequence_parallel_size 4 must divide the attention heads, 2"):
        GPT(config, sequence=_rank(0, 4))
    with pytest.raises(ValueError, match="model.fused blocks do not take sequence parallelism"):
        GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8, fused=True), sequence=_rank(0))
