"""Bad checkpoints given to `lightning-zero consolidate` and `fit --ckpt_path`, table-driven: damaged or crafted
copies of a real checkpoint (the stage2_checkpoint fixture), missing paths and bad outputs (configs, CLI
arguments, DeepSpeed JSON and estimate arguments: test_bad_input.py). Each case answers with exactly one line,
``lightning-zero <command>: error: ...`` naming the bad value, exit code 2, and writes or deletes nothing (the
case's directory is compared file by file, contents included) and starts no process group; unpickling runs
none of a checkpoint's code.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lightning_zero.cli.main import main
from tests.support.bad_input import Case, capture_runs, check_case, fit_args, one_line_error, prepare
from tests.support.helpers import Poison, poison_checkpoint


# --- what is done to copies of a real checkpoint (the stage2_checkpoint fixture) --------------------------------
def _edit_metadata(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(ckpt: Path) -> None:
        meta = json.loads((ckpt / "metadata.json").read_text())
        edit(meta)
        (ckpt / "metadata.json").write_text(json.dumps(meta))

    return damage


def _rename_file(old: str, new: str) -> Callable[[dict], None]:
    return lambda meta: meta["files"].update({new: meta["files"].pop(old)})


def _truncate(ckpt: Path) -> None:
    rank0 = ckpt / "rank-00000.pt"
    rank0.write_bytes(rank0.read_bytes()[:-100])


def _flip_a_byte(ckpt: Path) -> None:
    data = bytearray((ckpt / "rank-00000.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (ckpt / "rank-00000.pt").write_bytes(bytes(data))


def _poison(ckpt: Path) -> None:
    poison_checkpoint(ckpt, ckpt.parent / "marker")


def _poisoned_plain_file(ckpt: Path) -> None:
    """A single-file (plain Lightning) checkpoint with a Poison in its hyper-parameters, in ckpt's place."""
    shutil.rmtree(ckpt)
    torch.save({"state_dict": {}, "hyper_parameters": {"poison": Poison(ckpt.parent / "marker")}}, ckpt)


def _consolidate(checkpoint: str = "{ckpt}", output: str = "{tmp}/model.pt") -> list[str]:
    return ["consolidate", checkpoint, output]


def _unlink(name: str) -> Callable[[Path], None]:
    return lambda ckpt: (ckpt / name).unlink()


CHECKPOINT_CASES = [
    Case("consolidate_missing_dir", _consolidate("{tmp}/absent.ckpt"), "{tmp}/absent.ckpt: no such checkpoint"),
    Case(
        "consolidate_file_not_dir",
        _consolidate("{ckpt}/rank-00000.pt"),
        "rank-00000.pt: not a lightning_zero checkpoint (a directory with metadata.json)",
    ),
    Case(
        "consolidate_no_complete",
        _consolidate(),
        "incomplete checkpoint (no COMPLETE marker): its save was interrupted",
        damage=_unlink("COMPLETE"),
    ),
    Case(
        "consolidate_no_metadata",
        _consolidate(),
        "metadata.json: missing from the checkpoint",
        damage=_unlink("metadata.json"),
    ),
    Case(
        "consolidate_missing_rank_file",
        _consolidate(),
        "rank-00000.pt: missing from the checkpoint",
        damage=_unlink("rank-00000.pt"),
    ),
    Case("consolidate_truncated_rank_file", _consolidate(), "rank-00000.pt: truncated or changed: ", damage=_truncate),
    Case(
        "consolidate_corrupted_bytes",
        _consolidate(),
        "rank-00000.pt: corrupted: its xxh3_128 checksum does not match the metadata",
        damage=_flip_a_byte,
    ),
    Case(
        "consolidate_metadata_not_json",
        _consolidate(),
        "metadata.json: not valid JSON",
        damage=lambda c: (c / "metadata.json").write_text("{'stage': 2"),
    ),
    Case(
        "consolidate_metadata_version",
        _consolidate(),
        "checkpoint format version 99 is not supported",
        damage=_edit_metadata(lambda m: m.update(version=99)),
    ),
    Case(
        "consolidate_metadata_dotdot_name",
        _consolidate(),
        "files must be exactly lightning.pt and rank-00000.pt .. rank-00000.pt (and consolidated.ckpt), got ",
        damage=_edit_metadata(_rename_file("rank-00000.pt", "../../x")),
    ),
    Case(
        "consolidate_metadata_absolute_path",
        _consolidate(),
        "files must be exactly lightning.pt and rank-00000.pt .. rank-00000.pt (and consolidated.ckpt), got ",
        damage=_edit_metadata(_rename_file("lightning.pt", "/etc/passwd")),
    ),
    Case(
        "consolidate_metadata_huge_world_size",
        _consolidate(),
        "world_size must be an integer in [1, 1048576], got '1000000000000'",
        damage=_edit_metadata(lambda m: m.update(world_size=10**12)),
    ),
    Case(
        "consolidate_metadata_bad_dtype",
        _consolidate(),
        "units[0].params[0].dtype must be one of ",
        damage=_edit_metadata(lambda m: m["units"][0]["params"][0].update(dtype="complex1024")),
    ),
    Case("consolidate_poisoned_pickle", _consolidate(), "safe loading refuses", damage=_poison),
    Case(
        "consolidate_onto_a_directory",
        _consolidate(output="{tmp}"),
        "is a directory; give the path of the file to write",
    ),
    Case(
        "consolidate_into_a_missing_directory",
        _consolidate(output="{tmp}/absent/model.pt"),
        "{tmp}/absent: no such directory to write model.pt into",
    ),
    Case(
        "consolidate_unknown_output_format",
        _consolidate(output="{tmp}/model.txt"),
        "model.txt: the output must end in .ckpt, .pt, .pth, .bin or .safetensors",
    ),
    Case("consolidate_no_output", ["consolidate", "{ckpt}"], "the following arguments are required: output"),
    Case(
        "fit_ckpt_path_missing", fit_args("--ckpt_path", "{tmp}/absent.ckpt"), "{tmp}/absent.ckpt: no such checkpoint"
    ),
    Case(
        "fit_ckpt_path_no_complete",
        fit_args("--ckpt_path", "{ckpt}"),
        "incomplete checkpoint (no COMPLETE marker)",
        damage=_unlink("COMPLETE"),
    ),
    Case(
        "fit_ckpt_path_truncated",
        fit_args("--ckpt_path", "{ckpt}"),
        "rank-00000.pt: truncated or changed: ",
        damage=_truncate,
    ),
    Case(
        "fit_ckpt_path_poisoned_plain_file",  # Lightning's CLI reads its hyper-parameters first
        fit_args("--ckpt_path", "{ckpt}"),
        "run.ckpt: holds objects that safe loading refuses",
        damage=_poisoned_plain_file,
    ),
    Case(
        "fit_ckpt_path_crafted_metadata",
        fit_args("--ckpt_path", "{ckpt}"),
        "world_size must be an integer in [1, 1048576]",
        damage=_edit_metadata(lambda m: m.update(world_size=10**12)),
    ),
]


@pytest.fixture
def ran(monkeypatch) -> list:
    """The CLIs whose subcommand would have run (training, validating, ...): the bad cases must stop before."""
    return capture_runs(monkeypatch)


@pytest.mark.parametrize("case", CHECKPOINT_CASES, ids=str)
def test_bad_checkpoint(case, stage2_checkpoint, tmp_path, capsys, ran):
    check_case(case, tmp_path, stage2_checkpoint, capsys, ran)
    if case.damage in (_poison, _poisoned_plain_file):
        assert not (tmp_path / "marker").exists(), "unpickling ran the checkpoint's code"


def test_poisoned_pickle_names_the_switch(stage2_checkpoint, tmp_path, capsys, ran):
    """The refusal names weights_only and the consolidate switch; with --trust-pickles the (trusted) pickle
    is loaded as it is, which here runs its code."""
    case = next(c for c in CHECKPOINT_CASES if c.damage is _poison)
    args = prepare(case, tmp_path, stage2_checkpoint)
    err = one_line_error(args, capsys)
    assert "weights_only" in err and err.endswith("; here: --trust-pickles"), err
    assert not (tmp_path / "marker").exists()
    main([*args, "--trust-pickles"])
    assert (tmp_path / "marker").exists() and (tmp_path / "model.pt").is_file()
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'model.pt'}"
