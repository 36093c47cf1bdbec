"""load_pretrained checks every name and shape before it writes anything, and finds a DCP checkpoint's model under
the prefix fit finds (loading into every stage: tests/dist/test_pretrained.py)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed.checkpoint as dcp

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


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_checkpoint_is_found_under_the_prefix_fit_would_use(tmp_path, caplog):
    """A LightningModule holding the model as ``self.model`` loads a plain module's DCP checkpoint (and the
    other way round), the prefix said, as ``fit(ckpt_path=DCP_DIR)`` finds it (tests/dist/test_dcp_interop.py)."""

    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))

    torch.manual_seed(0)
    saved = Holder()
    dcp.save({"model": saved.model.state_dict()}, checkpoint_id=tmp_path / "plain", no_dist=True)
    dcp.save({"model": saved.state_dict()}, checkpoint_id=tmp_path / "held", no_dist=True)
    holder, plain = Holder(), Holder().model
    with caplog.at_level(logging.INFO):
        lightning_zero.load_pretrained(holder, tmp_path / "plain")
        lightning_zero.load_pretrained(plain, tmp_path / "held")
    assert all(torch.equal(v, saved.state_dict()[k]) for k, v in holder.state_dict().items())
    assert all(torch.equal(v, saved.model.state_dict()[k]) for k, v in plain.state_dict().items())
    assert "plain: the module's names are the saved ones (in section 'model') with the prefix 'model.' added" in (
        caplog.text
    )
    assert "held: the module's names are the saved ones (in section 'model') with the prefix 'model.' removed" in (
        caplog.text
    )
