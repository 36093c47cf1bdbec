"""A zero3 checkpoint of the tests' tiny Hugging Face GPT-2 (tied head) and Llama exported as
``save_pretrained`` writes it (``lightning-zero consolidate CKPT OUT --hf``): ``AutoModelForCausalLM.from_pretrained``
loads the trained fp32 weights exactly and computes the trained model's logits; in several shards with an
index too; a checkpoint without a Hugging Face model is refused with one line (exit 2) and nothing written."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch

from lightning_zero.checkpoint.format import CheckpointError
from lightning_zero.checkpoint.hugging_face import export_hugging_face
from tests.support.compare import full_state
from tests.support.helpers import make_trainer, run_cli, zero_strategy

transformers = pytest.importorskip("transformers")

from tests.support.hf_models import VOCAB, HFModule  # noqa: E402


def _train_and_save(rank: int, world: int, root) -> dict:
    states = {}
    for family in ("gpt2", "llama"):
        pl.seed_everything(0)
        trainer = make_trainer(zero_strategy(3, param_persistence_threshold=0), world, steps=2)
        trainer.fit(HFModule(family, lazy=True, steps=2))
        trainer.save_checkpoint(root / f"{family}.ckpt")
        states[family] = {k.removeprefix("model."): v.clone() for k, v in full_state(trainer.strategy).items()}
    return states


def test_exported_models_load_with_from_pretrained(ranks, tmp_path, capsys):
    states = ranks(_train_and_save, 2, tmp_path)[0]
    tokens = torch.randint(VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    for family, state in states.items():
        out = tmp_path / f"{family}-hf"
        code, printed, err = run_cli(capsys, "consolidate", str(tmp_path / f"{family}.ckpt"), str(out), "--hf")
        assert code == 0, err
        assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
        model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        loaded = model.state_dict()
        for key, value in state.items():
            assert torch.equal(loaded[key], value), (family, key)
        reference = transformers.AutoModelForCausalLM.from_config(model.config).eval()
        reference.load_state_dict(state, strict=False)
        with torch.no_grad():
            assert torch.equal(model(tokens).logits, reference(tokens).logits), family
        # several shards and their index, as save_pretrained writes large models
        sharded = export_hugging_face(
            tmp_path / f"{family}.ckpt", tmp_path / f"{family}-sharded", max_shard_bytes=20_000
        )
        index = json.loads((sharded / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 2
        again = transformers.AutoModelForCausalLM.from_pretrained(sharded).state_dict()
        assert all(torch.equal(again[k], v) for k, v in state.items())
        tied = family == "gpt2"  # its head is the embedding: one copy, as save_pretrained writes
        assert ("lm_head.weight" in index["weight_map"]) != tied, family
        config = json.loads((out / "config.json").read_text())
        assert (config["dtype"], config["torch_dtype"]) == ("float32", "float32")  # the masters, whatever trained
        foreign = tmp_path / f".{family}-again.partial"  # someone else's directory where ours would go
        foreign.mkdir()
        (foreign / "theirs.txt").write_text("keep")
        with pytest.raises(CheckpointError, match="exists and was not made by lightning_zero; nothing was overwritten"):
            export_hugging_face(tmp_path / f"{family}.ckpt", tmp_path / f"{family}-again")
        assert (foreign / "theirs.txt").read_text() == "keep"


def _plain_checkpoint(rank: int, world: int, root) -> None:
    from tests.support.helpers import EquivalenceModule

    trainer = make_trainer(zero_strategy(3), world, steps=1)
    trainer.fit(EquivalenceModule("toy", steps=1))
    trainer.save_checkpoint(root / "toy.ckpt")


def test_a_checkpoint_without_a_hugging_face_model_is_refused(ranks, tmp_path, capsys):
    ranks(_plain_checkpoint, 2, tmp_path)
    code, out, err = run_cli(capsys, "consolidate", str(tmp_path / "toy.ckpt"), str(tmp_path / "out"), "--hf")
    assert code == 2 and out == ""
    assert "holds no Hugging Face model" in err.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()
