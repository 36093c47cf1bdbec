"""torch.distributed.checkpoint interop with real FSDP2 (``fully_shard`` on 2 CPU ranks, gloo).

- A checkpoint FSDP2 saved, in the DCP recipe's layout (``{"model": ..., "optim": ...}``) and in torchtitan's
  (the model at the top level, the optimizer state flattened), resumes under zero1, zero2 and zero3 with Adam's
  state and a changed buffer: two more steps equal FSDP2's own two more steps; ``load_pretrained`` reads its weights.
- A zero3 checkpoint exported with ``lightning-zero consolidate CKPT OUT --dcp --strip-prefix model.`` loads into
  FSDP2 (``get_state_dict``, ``dcp.load``, ``set_state_dict``), which then continues as lightning_zero continued.
- Another optimizer's state (SGD here, Adam's saved), other param groups, a truncated data file (named, on every
  rank), two sections that hold the weights alike, and a ``.metadata`` naming a class DCP's metadata does not hold
  are refused with one line.
"""

from __future__ import annotations

import pickle
import shutil

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

from lightning_zero.checkpoint.dcp import read_dcp
from lightning_zero.checkpoint.format import CheckpointError
from lightning_zero.checkpoint.pretrained import load_pretrained
from tests.support.compare import full_state
from tests.support.helpers import make_trainer, run_cli, zero_strategy

SAVED_AT, STEPS = 3, 5
RTOL, ATOL = 1e-5, 1e-7  # the exactness contract (fp32)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 10)  # 10 rows: FSDP2's dim-0 shards and ours cut it differently
        self.out = torch.nn.Linear(10, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x))) * self.scale


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(8, 6, generator=generator) for _ in range(STEPS)]


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) - x[:, :3]).square().mean()


def _adamw(params, kind=torch.optim.AdamW) -> torch.optim.Optimizer:
    return kind(params, lr=1e-2, weight_decay=0.1) if kind is torch.optim.AdamW else kind(params, lr=1e-2)


class NetModule(pl.LightningModule):
    def __init__(self, batches: list[torch.Tensor], optimizer=torch.optim.AdamW) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Net()
        self.batches, self.kind = batches, optimizer

    def training_step(self, x, _):
        return _loss(self.model, x)

    def configure_optimizers(self):
        return _adamw(self.parameters(), self.kind)

    def train_dataloader(self):  # every rank the same batches, as the FSDP2 job below: the mean gradient is theirs
        return DataLoader(self.batches, batch_size=None)


def _fsdp2() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    fully_shard(model.inp)
    fully_shard(model.out)
    fully_shard(model)
    return model, _adamw(model.parameters())


def _train(model, optimizer, batches) -> None:
    for x in batches:
        _loss(model, x).backward()
        optimizer.step()
        optimizer.zero_grad()


def _whole(model) -> dict[str, torch.Tensor]:
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def _fsdp2_saves(rank: int, world: int, root) -> dict:
    model, optimizer = _fsdp2()
    with torch.no_grad():
        model.scale.mul_(2)  # a buffer that is not the module's initial one
    _train(model, optimizer, _batches()[:SAVED_AT])
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root / "recipe")
    flattened = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({**model_sd, "optimizer": flattened}, checkpoint_id=root / "torchtitan")
    saved = _whole(model)
    _train(model, optimizer, _batches()[SAVED_AT:])
    return saved, _whole(model)


def _zero_resumes(rank: int, world: int, root) -> dict:
    finals = {}
    for stage, layout in ((1, "recipe"), (2, "torchtitan"), (3, "recipe"), (3, "torchtitan")):
        trainer = make_trainer(zero_strategy(stage), world, steps=STEPS - SAVED_AT, accumulate=1, clip=None)
        trainer.fit(NetModule(_batches()[SAVED_AT:]), ckpt_path=root / layout)
        finals[(stage, layout)] = {k.removeprefix("model."): v for k, v in full_state(trainer.strategy).items()}
    truncated = r"rank \d: .*damaged/__1_0\.distcp: truncated: 100 bytes, and \.metadata stores \S+ at bytes \["
    with pytest.raises(CheckpointError, match=truncated):  # agreed: no rank left waiting
        trainer = make_trainer(zero_strategy(3), world, steps=1, accumulate=1, clip=None)
        trainer.fit(NetModule(_batches()), ckpt_path=root / "damaged")
    with pytest.raises(CheckpointError, match=r"is a SGD, whose param groups have \['dampening', 'momentum'"):
        trainer = make_trainer(zero_strategy(2), world, steps=1, accumulate=1, clip=None)
        trainer.fit(NetModule(_batches(), optimizer=torch.optim.SGD), ckpt_path=root / "recipe")
    return finals


def test_fsdp2_checkpoints_resume_under_every_stage(ranks, tmp_path):
    saved, reference = ranks(_fsdp2_saves, 2, tmp_path)[0]
    shutil.copytree(tmp_path / "recipe", tmp_path / "damaged")
    with open(tmp_path / "damaged" / "__1_0.distcp", "r+b") as f:  # FSDP2's rank 1 wrote it: half of every tensor
        f.truncate(100)
    for (stage, layout), final in ranks(_zero_resumes, 2, tmp_path)[0].items():
        assert final.keys() == reference.keys()
        for key, value in reference.items():
            torch.testing.assert_close(final[key], value, rtol=RTOL, atol=ATOL, msg=f"zero{stage} {layout} {key}")
    assert torch.equal(reference["scale"], 2 * torch.linspace(0.5, 1.5, 3))
    for layout in ("recipe", "torchtitan"):  # the weights alone, for fine-tuning
        model = Net()
        load_pretrained(model, tmp_path / layout)
        assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items()), layout


def _zero_trains_and_saves(rank: int, world: int, root) -> dict:
    save = ModelCheckpoint(dirpath=root, filename="zero3", every_n_train_steps=SAVED_AT, save_top_k=-1)
    trainer = make_trainer(
        zero_strategy(3), world, steps=STEPS, accumulate=1, clip=None, callbacks=[save], enable_checkpointing=True
    )
    trainer.fit(NetModule(_batches()))
    return {k.removeprefix("model."): v for k, v in full_state(trainer.strategy).items()}


def _fsdp2_loads(rank: int, world: int, exported) -> dict:
    model, optimizer = _fsdp2()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=exported)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    steps = {float(s["step"]) for s in optimizer.state.values()}
    _train(model, optimizer, _batches()[SAVED_AT:])
    return {"steps": steps, "weights": _whole(model)}


def test_an_exported_checkpoint_continues_under_fsdp2(ranks, tmp_path, capsys):
    reference = ranks(_zero_trains_and_saves, 2, tmp_path)[0]
    exported = tmp_path / "exported"
    code, printed, err = run_cli(
        capsys, "consolidate", str(tmp_path / "zero3.ckpt"), str(exported), "--dcp", "--strip-prefix", "model."
    )
    assert code == 0, err
    assert sorted(p.name for p in exported.iterdir()) == [".metadata", "__0_0.distcp"]
    fsdp2 = ranks(_fsdp2_loads, 2, exported)[0]
    assert fsdp2["steps"] == {float(SAVED_AT)}
    assert fsdp2["weights"].keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(fsdp2["weights"][key], value, rtol=RTOL, atol=ATOL, msg=key)
    # bad input: one line, exit 2, nothing written
    code, printed, err = run_cli(capsys, "consolidate", str(tmp_path / "zero3.ckpt"), str(tmp_path / "x"), "--dcp",
                                 "--strip-prefix", "net.")  # fmt: skip
    assert code == 2 and "do not start with strip_prefix 'net.'" in err and not (tmp_path / "x").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_metadata_is_data_and_groups_must_match(tmp_path):
    torch.manual_seed(0)
    model = Net()
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "ok", no_dist=True)
    names = [f"model.{k}" for k, _ in model.named_parameters()]
    module_names = [f"model.{k}" for k in model.state_dict()]
    meta, lightning, reader = read_dcp(tmp_path / "ok", model_names=module_names, optimizer_names=[[names]])
    assert meta.weights_only and meta.optimizers == [] and "optimizer_states" not in lightning
    out = torch.empty(60)
    reader.read("model.inp.weight", 0, 60, out)
    assert torch.equal(out, model.inp.weight.detach().reshape(-1))
    out = torch.empty(7)
    reader.read("model.inp.weight", 5, 12, out)  # across a row boundary
    assert torch.equal(out, model.inp.weight.detach().reshape(-1)[5:12])

    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optim": _by_name(model, optimizer)}
    dcp.save(state, checkpoint_id=tmp_path / "adam", no_dist=True)
    with pytest.raises(CheckpointError, match=r"differ .* \[\['model.inp.bias', 'model.inp.weight'\], \['model.out"):
        read_dcp(tmp_path / "adam", model_names=module_names, optimizer_names=[[names[:2], names[2:]]])
    with pytest.raises(CheckpointError, match="this module configures 2 optimizers"):
        read_dcp(tmp_path / "adam", model_names=module_names, optimizer_names=[[names[:2]], [names[2:]]])

    # a 0-d parameter's moments are elementwise (one element), its step a scalar
    temperature = torch.nn.Parameter(torch.tensor(2.0))
    adam = torch.optim.AdamW([temperature])
    temperature.square().backward()
    adam.step()
    saved = {"state": {"t": adam.state_dict()["state"][0]}, "param_groups": [{**adam.param_groups[0], "params": ["t"]}]}
    dcp.save({"model": {"t": temperature.detach()}, "optim": saved}, checkpoint_id=tmp_path / "0d", no_dist=True)
    *_, reader = read_dcp(tmp_path / "0d", model_names=["t"], optimizer_names=[[["t"]]])
    scalars, elementwise = reader.state_of("t")
    assert list(scalars) == ["step"] and sorted(elementwise) == ["exp_avg", "exp_avg_sq"]
    moment = torch.empty(1)
    reader.read("t", 0, 1, moment, key="exp_avg")
    assert torch.equal(moment, adam.state[temperature]["exp_avg"].reshape(1))

    # an average beside the model: the section named model is the model; two sections alike: one line
    dcp.save({"ema": model.state_dict(), "model": model.state_dict()}, checkpoint_id=tmp_path / "ema", no_dist=True)
    assert read_dcp(tmp_path / "ema", model_names=module_names, optimizer_names=[])[2].keys["model.inp.bias"] == (
        "model.inp.bias"
    )
    dcp.save({"a": model.state_dict(), "b": model.state_dict()}, checkpoint_id=tmp_path / "two", no_dist=True)
    with pytest.raises(CheckpointError, match=r"2 sections hold these weights equally well: \['a', 'b'\]"):
        read_dcp(tmp_path / "two", model_names=module_names, optimizer_names=[])

    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / ".metadata").write_bytes(pickle.dumps(print))
    with pytest.raises(CheckpointError, match=r"refers to builtins.print, which DCP's metadata does not hold"):
        read_dcp(evil, model_names=module_names, optimizer_names=[])


def _by_name(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state dict keyed by parameter name, as get_optimizer_state_dict returns it."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved = optimizer.state_dict()
    return {
        "state": {names[id(params[i])]: s for i, s in saved["state"].items()},
        "param_groups": [{**g, "params": [names[id(params[i])] for i in g["params"]]} for g in saved["param_groups"]],
    }
