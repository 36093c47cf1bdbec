"""load_pretrained checks every name and shape before it writes anything (loading into every stage:
tests/dist/test_pretrained.py)."""

from __future__ import annotations

import pytest
import torch

import lightning_zero  # noqa: E402
from tests.support.hf_models import build, pretrained_state  # noqa: E402


def test_mismatched_names_fail_before_anything_is_written():
    torch.manual_seed(0)
    model = build("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = dict(pretrained_state())
    state["model.extra.weight"] = torch.zeros(3)
    del state["lm_head.weight"]
    state["model.norm.weight"] = torch.zeros(7)
    with pytest.raises(
        ValueError,
        match=r"missing \['lm_head.weight'\]; unexpected \['model.extra.weight'\]; shapes differ.*model.norm",
    ):
        lightning_zero.load_pretrained(model, state)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    del state["model.norm.weight"]  # a shape that differs is an error even when not strict (as in torch)
    lightning_zero.load_pretrained(model, state, strict=False)  # what matches is loaded, the rest is left
    assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.weight, before["lm_head.weight"])
