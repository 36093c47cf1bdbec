"""Files that are not ours, or not what they claim, in one process:

- outputs are written as new files, never through a link: a link placed where a temporary goes is left alone
  (consolidate's .pt and .safetensors, ``write_atomically`` under convert-deepspeed), and an output that is a link
  (dangling) is one line, exit 2, for every command that writes one;
- a read that fails says why: a rank file whose partition is not the size the metadata gives names the file and
  the parameter; a DCP directory's truncated file, a byte range holding another tensor, and a value that safe
  loading refuses name the file and the tensor (not ``CheckpointException ranks:dict_keys([0])``);
- a Hugging Face config recorded in a checkpoint nested thousands deep, or huge, is one line (exit 2), and a
  model whose config is such is saved without it, with a warning.
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from lightning_zero.checkpoint import atomic
from lightning_zero.checkpoint.atomic import write_atomically
from lightning_zero.checkpoint.consolidate import consolidate
from lightning_zero.checkpoint.dcp import DcpSource
from lightning_zero.checkpoint.format import WRITTEN_DIGEST, CheckpointError, file_digest
from lightning_zero.checkpoint.hugging_face import HUGGING_FACE, MAX_CONFIG_BYTES, describe
from tests.support.helpers import run_cli


def _rewrite(ckpt: Path, name: str, content: object) -> None:
    """Replaces a checkpoint's file and records its new size and checksum, so only what reads it can object."""
    torch.save(content, ckpt / name)
    meta = json.loads((ckpt / "metadata.json").read_text())
    meta["files"][name] = {"bytes": (ckpt / name).stat().st_size, WRITTEN_DIGEST: file_digest(ckpt / name)}
    (ckpt / "metadata.json").write_text(json.dumps(meta))


def test_temporaries_never_follow_a_link(stage2_checkpoint, tmp_path, monkeypatch):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    for name in ("model.pt", "model.safetensors", "converted.ckpt"):
        (out / f".{name}.tmp").symlink_to(victim)  # where a temporary of a fixed name went
    weights = torch.load(consolidate(stage2_checkpoint, out / "model.pt"), weights_only=True)
    safetensors = load_file(consolidate(stage2_checkpoint, out / "model.safetensors"))
    assert weights.keys() == safetensors.keys() and all(torch.equal(weights[k], safetensors[k]) for k in weights)
    write_atomically(out / "converted.ckpt", lambda f: torch.save({"state_dict": weights}, f))  # convert-deepspeed's
    assert victim.read_text() == "precious"
    # a fresh name that is taken, by a link, is passed over: created exclusively, never opened through the link
    names = iter(["taken", "free"])
    monkeypatch.setattr(atomic.secrets, "token_hex", lambda _: next(names))
    (out / ".again.pt.taken.tmp").symlink_to(victim)
    write_atomically(out / "again.pt", lambda f: f.write(b"data"))
    assert (out / "again.pt").read_bytes() == b"data"
    assert victim.read_text() == "precious"
    assert not any(p.is_symlink() for p in out.iterdir() if not p.name.endswith(".tmp"))


@pytest.mark.parametrize(
    "command", [["consolidate"], ["consolidate", "--hf"], ["consolidate", "--dcp"], ["convert-deepspeed"]]
)
def test_an_output_that_is_a_link_is_one_line(stage2_checkpoint, tmp_path, capsys, command):
    link = tmp_path / ("out.pt" if command in (["consolidate"], ["convert-deepspeed"]) else "out")
    link.symlink_to(tmp_path / "nowhere")
    code, _, err = run_cli(capsys, command[0], str(stage2_checkpoint), str(link), *command[1:])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{link}: is a symbolic link (to {tmp_path / 'nowhere'}); nothing is written through or over" in err
    assert [p.name for p in tmp_path.iterdir()] == [link.name]  # (nothing else written)


def test_a_rank_file_unlike_its_metadata_names_the_file_and_the_parameter(stage2_checkpoint, tmp_path):
    ckpt = tmp_path / "mixed.ckpt"
    shutil.copytree(stage2_checkpoint, ckpt)
    data = torch.load(ckpt / "rank-00000.pt", weights_only=True)
    size = data["units"][1]["master"].numel()
    data["units"][1]["master"] = data["units"][1]["master"][:-2].clone()  # (a partition of another checkpoint)
    _rewrite(ckpt, "rank-00000.pt", data)
    message = rf"rank-00000\.pt: the master of unit 1 \(net\.\S+'s\) is \[{size - 2}\]; the metadata's shapes give"
    with pytest.raises(CheckpointError, match=rf"{message} rank 0 \[{size}\]"):
        consolidate(ckpt, tmp_path / "out.pt")


@pytest.fixture
def dcp_dir(tmp_path) -> Path:
    """A DCP checkpoint, one process, of a Linear and a string: {"model.weight", "model.bias", "note.text"}."""
    torch.manual_seed(0)
    state = {"model": torch.nn.Linear(6, 10).state_dict(), "note": {"text": "hello"}}
    dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    return tmp_path / "dcp"


def _edit_storage(path: Path, edit) -> None:
    """``edit(storage_data by key)`` on the directory's .metadata (DCP's own pickle)."""
    metadata = pickle.loads((path / ".metadata").read_bytes())
    edit({index.fqn: info for index, info in metadata.storage_data.items()})
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_read_failures_name_the_file_and_the_tensor(dcp_dir):
    data = dcp_dir / "__0_0.distcp"
    original = data.read_bytes()
    source = DcpSource(dcp_dir)
    weight = torch.empty(60)
    source.read("model.weight", 0, 60, weight)

    def swap(storage) -> None:  # the weight's byte range holds the bias
        weight, bias = storage["model.weight"], storage["model.bias"]
        (weight.offset, weight.length), (bias.offset, bias.length) = (
            (bias.offset, bias.length),
            (weight.offset, weight.length),
        )

    _edit_storage(dcp_dir, swap)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: model\.weight, at bytes \[[\d,]+, [\d,]+\), is not wh"):
        DcpSource(dcp_dir).read("model.weight", 0, 60, weight)

    refused = io.BytesIO()
    torch.save(Fraction(1, 3), refused)  # a class safe loading does not allow

    def refer_to_refused(storage) -> None:
        storage["note.text"].offset, storage["note.text"].length = len(original), len(refused.getvalue())

    _edit_storage(dcp_dir, refer_to_refused)
    data.write_bytes(original + refused.getvalue())
    message = r"__0_0\.distcp: holds objects that safe loading refuses \(.*fractions\.Fraction.*\), in note\.text"
    with pytest.raises(CheckpointError, match=message):
        DcpSource(dcp_dir).load({"note.text": None})

    data.write_bytes(original[:100])
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: truncated: 100 bytes, and \.metadata stores \S+ at"):
        DcpSource(dcp_dir)


def _deep(depth: int) -> dict:
    config = {"model_type": "llama"}
    for _ in range(depth):
        config = {"model_type": "llama", "nested": config}
    return config


def _with_lightning_state(source: Path, ckpt: Path, key: str, value) -> Path:
    """A copy of the checkpoint ``source`` whose Lightning state holds ``value`` under ``key`` (pickled with room
    for its depth)."""
    shutil.copytree(source, ckpt)
    lightning = torch.load(ckpt / "lightning.pt", weights_only=True)
    lightning[key] = value
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)
    try:
        _rewrite(ckpt, "lightning.pt", lightning)
    finally:
        sys.setrecursionlimit(limit)
    return ckpt


@pytest.mark.parametrize(
    "config, problem",
    [(_deep(3000), "nested more than 64 deep"), ({"model_type": "x" * MAX_CONFIG_BYTES}, "larger than 16,777,216")],
)
def test_a_hostile_hugging_face_config_is_one_line(stage2_checkpoint, tmp_path, capsys, config, problem):
    ckpt = _with_lightning_state(
        stage2_checkpoint, tmp_path / "hostile.ckpt", HUGGING_FACE, {"prefix": "", "config": config}
    )
    code, _, err = run_cli(capsys, "consolidate", str(ckpt), str(tmp_path / "hf"), "--hf")
    assert code == 2 and len(err.strip().splitlines()) == 1, err[-2000:]
    assert f"its Hugging Face config is {problem}" in err and "a config.json is a JSON object nested at most 64" in err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("depth, problem", [(100, "nested more than 64 deep"), (3000, "not JSON")])
def test_a_model_whose_config_is_too_deep_is_saved_without_it(depth, problem):
    class Config:
        def to_json_string(self) -> str:
            return '{"a": ' * depth + "1" + "}" * depth

    class PreTrained(torch.nn.Module):
        config = Config()

        def save_pretrained(self) -> None: ...

    holder = torch.nn.Sequential(PreTrained())
    with pytest.warns(UserWarning, match=f"'s config is {problem}.*; checkpoints will not export it for Hugging Face"):
        assert describe(holder) == {}


def test_hyper_parameters_nested_too_deep_are_one_line(stage2_checkpoint, tmp_path, capsys):
    """The Lightning state a checkpoint records is data: hyper-parameters nested past Python's recursion limit
    make ``consolidate`` to a .ckpt one line, not a RecursionError's traceback."""
    ckpt = _with_lightning_state(stage2_checkpoint, tmp_path / "deep.ckpt", "hyper_parameters", _deep(3000))
    code, _, err = run_cli(capsys, "consolidate", str(ckpt), str(tmp_path / "out.ckpt"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err[-2000:]
    assert "nested too deep to be written again" in err
    assert not (tmp_path / "out.ckpt").exists()
