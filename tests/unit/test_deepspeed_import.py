"""Migration in from DeepSpeed: real ZeRO stage 1, 2 and 3 checkpoints (2 ranks, fp32, fp16, bf16, optimizer
offload, written by DeepSpeed 0.19.8 on the CPU: tests/fixtures/deepspeed/make_fixtures.py) convert, without
trusting their pickles, to plain Lightning checkpoints whose weights and Adam state are exactly those of the live
DeepSpeed engine, and a lightning_zero fit resumes from one that Lightning's own DeepSpeedStrategy wrote. A file
holding anything but tensors, containers and DeepSpeed's classes is refused and runs nothing. DeepSpeed itself
is not needed here."""

from __future__ import annotations

import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

from lightning_zero.checkpoint import deepspeed_import
from lightning_zero.checkpoint.atomic import write_atomically
from lightning_zero.checkpoint.deepspeed_import import convert
from lightning_zero.checkpoint.format import CheckpointError
from lightning_zero.cli.main import main
from tests.support.helpers import DEEPSPEED_FIXTURES, Poison, deepspeed_expected

TRAINED = [["emb.weight", "body.weight", "out.weight"], ["body.bias", "norm.weight", "norm.bias", "out.bias"]]
REFUSAL = (
    ": safe loading refuses io.open (it allows tensors, containers and DeepSpeed's own classes): unpickling it"
    " could run code; pass --trust-pickles (trust_pickles=True) only for a checkpoint you trust"
)


def _check(converted: dict, expected: dict, prefix: str = "") -> None:
    """Weights exactly the engine's, and Adam's state per parameter, in the param groups' order."""
    assert list(converted["state_dict"]) == expected["state_dict_keys"]
    for name, value in expected["weights"].items():
        assert converted["state_dict"][name].dtype == torch.float32
        assert torch.equal(converted["state_dict"][name], value), name
    optimizer = converted["optimizer_states"][0]
    names = [prefix + n for group in TRAINED for n in group]
    assert [g["params"] for g in optimizer["param_groups"]] == [[0, 1, 2], [3, 4, 5, 6]]
    assert [g["weight_decay"] for g in optimizer["param_groups"]] == [0.1, 0.0]
    for index, name in enumerate(names):
        state = optimizer["state"][index]
        assert float(state["step"]) == expected["step"]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], expected[key][name]), (name, key)


# aligned: padding after each parameter; roundrobin: each group flattened in another order; bf16/fp16: 16-bit
# weights and an fp32 master (bf16 files named bf16_*; fp16 ones hold DeepSpeed's DynamicLossScaler); offload: the
# master and Adam's state kept in host memory.
ENGINE_FIXTURES = [
    "zero1", "zero2", "zero3", "zero2-aligned", "zero2-roundrobin", "zero2-bf16", "zero1-bf16", "zero3-bf16",
    "zero1-fp16", "zero3-fp16", "zero2-offload", "zero3-offload", "zero3-offload-bf16",
]  # fmt: skip


@pytest.mark.parametrize("name", ENGINE_FIXTURES)
def test_every_stage_converts_exactly_without_trusting_pickles(tmp_path, name):
    out = tmp_path / "out.ckpt"
    convert(DEEPSPEED_FIXTURES / name, out, trust_pickles=False)
    converted = torch.load(out, weights_only=True)  # the file itself needs no trust
    _check(converted, deepspeed_expected(name))
    assert converted["state_dict"]["head.weight"] is converted["state_dict"]["emb.weight"]  # still tied
    assert (converted["global_step"], converted["epoch"], converted["note"]) == (2, 1, "client state")
    assert converted["optimizer_states"][0]["param_groups"][1]["lr"] == 5e-3
    # The tag directory itself converts the same.
    again = tmp_path / "again.ckpt"
    convert(DEEPSPEED_FIXTURES / name / "global_step2", again, trust_pickles=False)
    assert torch.equal(
        torch.load(again, weights_only=True)["state_dict"]["out.weight"], converted["state_dict"]["out.weight"]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.ckpt", "out.ckpt"]  # no temporary files left


def _poison(tag: Path, marker: Path) -> Path:
    """Puts a Poison where the conversion never looks (DeepSpeed's scheduler state) into the model states; the
    optimizer files keep DeepSpeed's classes, so the poison is the only thing safe loading refuses."""
    model = tag / "mp_rank_00_model_states.pt"
    loaded = torch.load(model, weights_only=True)
    torch.save({**loaded, "lr_scheduler": Poison(marker)}, model)
    return model


def test_a_poisoned_pickle_is_refused_and_runs_nothing(tmp_path):
    tag, marker = _copy(tmp_path, "zero2") / "global_step2", tmp_path / "marker"
    model = _poison(tag, marker)
    with pytest.raises(CheckpointError) as raised:
        convert(tag, tmp_path / "out.ckpt", trust_pickles=False)
    assert str(raised.value) == f"{model}{REFUSAL}"
    assert not marker.exists() and not (tmp_path / "out.ckpt").exists()
    # Trusted, the same file runs the poison: the refusal above is what stopped it.
    convert(tag, tmp_path / "out.ckpt", trust_pickles=True)
    assert marker.exists()
    _check(torch.load(tmp_path / "out.ckpt", weights_only=True), deepspeed_expected("zero2"))


def test_a_pickle_safe_loading_cannot_parse_says_why_and_loads_when_trusted(tmp_path):
    path = tmp_path / "protocol4.pt"
    torch.save({"step": torch.tensor(2.0)}, path, pickle_protocol=4)  # opcodes torch's safe unpickler lacks
    with pytest.raises(CheckpointError) as raised:
        deepspeed_import._load(path, trust_pickles=False)
    assert str(raised.value).startswith(f"{path}: safe loading refuses its pickle (Unsupported operand 149) (")
    assert torch.equal(deepspeed_import._load(path, trust_pickles=True)["step"], torch.tensor(2.0))


def _touch(path: str) -> None:
    Path(path).touch()


class _CallsTouch:
    """Unpickles as ``_touch(marker)`` with state set on what it returns."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (_touch, (self.marker,), {"state": "set"})


def test_a_deepspeed_name_stands_for_nothing_that_runs(tmp_path, monkeypatch):
    # A pickle naming a "DeepSpeed" callable (here a function that touches a file, under a deepspeed module made up
    # for the save), calling it and setting state on what it returns: loading gets inert data, safe or trusted.
    for module in ("deepspeed", "deepspeed.evil"):
        monkeypatch.setitem(sys.modules, module, types.ModuleType(module))
    monkeypatch.setattr(_touch, "__module__", "deepspeed.evil")
    monkeypatch.setattr(sys.modules["deepspeed.evil"], "_touch", _touch, raising=False)
    marker = tmp_path / "marker"
    torch.save({"x": _CallsTouch(marker)}, tmp_path / "evil.pt")
    monkeypatch.undo()  # DeepSpeed is not installed for the load, as for a user
    for trust in (False, True):
        stub = deepspeed_import._load(tmp_path / "evil.pt", trust_pickles=trust)["x"]
        assert isinstance(stub, deepspeed_import._Stub) and type(stub).__module__ == "deepspeed.evil"
        assert (stub.args, stub.state) == ((str(marker),), {"state": "set"})
        assert not marker.exists()


def _copy(tmp_path: Path, name: str) -> Path:
    return Path(shutil.copytree(DEEPSPEED_FIXTURES / name, tmp_path / name))


def _rewrite(path: Path, edit) -> None:
    """Loads a DeepSpeed file, edits it and saves it again without DeepSpeed's classes (they cannot be
    pickled here): only what the conversion reads is kept."""
    loaded = deepspeed_import._load(path, trust_pickles=True)
    saved = loaded.get("optimizer_state_dict")
    if saved is not None:
        saved["zero_stage"] = deepspeed_import._stage_of(loaded)
        for key in ("loss_scaler", "param_slice_mappings"):
            saved.pop(key, None)
    edit(loaded)
    write_atomically(path, lambda f: torch.save(loaded, f))  # a new file: the loaded one is memory-mapped


def _bad_inputs(tmp_path: Path):
    """(directory, what the error says) for each kind of bad input."""
    z2, z3 = _copy(tmp_path, "zero2"), _copy(tmp_path, "zero3")
    tag2, tag3 = z2 / "global_step2", z3 / "global_step2"
    yield tmp_path / "nowhere", f"{tmp_path / 'nowhere'}: no such directory"
    (tmp_path / "empty").mkdir()
    yield tmp_path / "empty", f"{tmp_path / 'empty'}: not a DeepSpeed checkpoint: no mp_rank_00_model_states.pt"
    (z2 / "latest").write_text("global_step9")
    yield z2, f"{z2 / 'latest'}: names tag 'global_step9', but {z2 / 'global_step9'} is not a directory"
    (z2 / "latest").write_text("global_step2")

    rank1 = tag2 / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = rank1.read_bytes()
    rank1.write_bytes(data[: len(data) // 2])
    yield z2, f"{rank1}: not a readable checkpoint file"
    rank1.unlink()
    yield z2, f"{rank1}: missing (the checkpoint was saved by 2 ranks)"
    shutil.copy(tag3 / rank1.name, rank1)  # stage 3's rank 1 next to stage 2's rank 0
    yield z2, f"{rank1}: not of the same save as zero_pp_rank_0_mp_rank_00_optim_states.pt (ZeRO stage 2, 2 ranks)"
    shutil.copy(DEEPSPEED_FIXTURES / "zero2" / "global_step2" / rank1.name, rank1)
    _rewrite(rank1, lambda f: f["optimizer_state_dict"].update(partition_count=[4, 4]))
    yield z2, f"{rank1}: not of the same save"
    shutil.copy(DEEPSPEED_FIXTURES / "zero2" / "global_step2" / rank1.name, rank1)
    extra = tag2 / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    shutil.copy(rank1, extra)
    yield z2, f"{extra}: not of the same save"
    extra.unlink()

    model = tag2 / "mp_rank_00_model_states.pt"
    shutil.copy(model, tag2 / "mp_rank_01_model_states.pt")
    yield z2, f"{tag2 / 'mp_rank_01_model_states.pt'}: tensor-parallel checkpoints (model-parallel rank > 0)"
    (tag2 / "mp_rank_01_model_states.pt").unlink()
    _rewrite(model, lambda f: f.update(dp_world_size=4))
    yield z2, f"{model}: saved by 4 ranks, the optimizer files by 2"
    _rewrite(
        model, lambda f: f.update(dp_world_size=2) or f["param_shapes"][0].update({"out.weight": torch.Size([5, 8])})
    )
    yield z2, "zero_pp_rank_0_mp_rank_00_optim_states.pt: flat group 0: holds 125 elements, its parameters 120"
    _rewrite(model, lambda f: f["param_shapes"][0].update({"out.weight": torch.Size([5, 10])}))
    yield z2, "flat group 0: holds 125 elements, too few for out.weight (5, 10)"
    rank0 = tag2 / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    _rewrite(rank0, lambda f: f["optimizer_state_dict"].update(zero_stage=0))
    yield z2, f"{rank0}: ZeRO stage 0 is not supported (1, 2 or 3)"

    (tag3 / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    yield z3, f"{tag3 / 'zero_pp_rank_1_mp_rank_00_model_states.pt'}: missing (ZeRO stage 3)"


def test_bad_inputs_fail_with_one_line_naming_the_file(tmp_path):
    for directory, message in _bad_inputs(tmp_path):
        with pytest.raises(CheckpointError) as raised:
            convert(directory, tmp_path / "out.ckpt", trust_pickles=True)
        assert message in str(raised.value) and "\n" not in str(raised.value), (message, str(raised.value))
        assert not (tmp_path / "out.ckpt").exists()


def test_command_line(tmp_path, capsys):
    main(["convert-deepspeed", str(DEEPSPEED_FIXTURES / "zero3"), str(tmp_path / "out.ckpt")])
    assert capsys.readouterr().out == (
        f"{tmp_path / 'out.ckpt'}: ZeRO stage 3 checkpoint of 2 ranks, 11 tensors, with optimizer state\n"
    )
    tag = _copy(tmp_path, "zero2") / "global_step2"
    model = _poison(tag, tmp_path / "marker")
    with pytest.raises(SystemExit) as exited:
        main(["convert-deepspeed", str(tag), str(tmp_path / "refused.ckpt")])
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"lightning-zero convert-deepspeed: error: {model}{REFUSAL}\n"
    assert not (tmp_path / "marker").exists() and not (tmp_path / "refused.ckpt").exists()


def test_weights_convert_where_the_optimizer_state_cannot(tmp_path, capsys):
    tag = _copy(tmp_path, "zero2") / "global_step2"
    for rank in (0, 1):  # as an elastic checkpoint saves it: no torch state_dict of the optimizer
        _rewrite(
            tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
            lambda f: f["optimizer_state_dict"].update(base_optimizer_state=[{}]),
        )
    main(["convert-deepspeed", str(tag.parent), str(tmp_path / "out.ckpt")])
    assert capsys.readouterr().out.endswith(
        "11 tensors, without optimizer state (no torch optimizer state_dict per rank (an elastic checkpoint or a"
        " DeepSpeed optimizer))\n"
    )
    converted = torch.load(tmp_path / "out.ckpt", weights_only=True)
    assert "optimizer_states" not in converted
    assert torch.equal(converted["state_dict"]["out.weight"], deepspeed_expected("zero2")["weights"]["out.weight"])


def test_a_step_kept_in_the_param_group_moves_to_each_parameter(tmp_path):
    def as_fused_adam(f):  # DeepSpeed's FusedAdam keeps "step" in the param group, not in the state
        base = f["optimizer_state_dict"]["base_optimizer_state"]
        for index, group in enumerate(base["param_groups"]):
            group["step"] = int(base["state"][index].pop("step"))

    tag = _copy(tmp_path, "zero1") / "global_step2"
    for rank in (0, 1):
        _rewrite(tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", as_fused_adam)
    convert(tag, tmp_path / "out.ckpt", trust_pickles=True)
    state = torch.load(tmp_path / "out.ckpt")["optimizer_states"][0]["state"]
    assert all(torch.equal(s["step"], torch.tensor(2.0)) for s in state.values()) and len(state) == 7
    assert len({s["step"].data_ptr() for s in state.values()}) == 7  # torch steps each in place


def test_lightning_deepspeed_checkpoint_keeps_lightning_state(tmp_path):
    convert(DEEPSPEED_FIXTURES / "lightning.ckpt", tmp_path / "out.ckpt", trust_pickles=False)
    converted = torch.load(tmp_path / "out.ckpt")
    expected = deepspeed_expected("lightning")
    _check(converted, expected, prefix="net.")
    assert converted["global_step"] == expected["step"] == 3
    assert converted["loops"]["fit_loop"]["epoch_loop.state_dict"] == {"_batches_that_stepped": 3}
    assert converted["lr_schedulers"][0]["last_epoch"] == 3
    assert [g["lr"] for g in converted["optimizer_states"][0]["param_groups"]] == expected["lr"]
