"""What the bad-input tests (tests/unit/test_bad_input*.py) share: a case, the ``fit`` command line it starts
from, and running one: each case answers with exactly one line, ``lightning-zero <command>: error: ...``
naming the bad value, exit code 2, and writes or deletes nothing (the case's directory is compared file by
file, contents included) and starts no process group."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from lightning_zero.cli.main import DEBUG_ENV, ZeroCLI, main
from tests.support.helpers import snapshot_files

ROOT = Path(__file__).resolve().parents[2]
GPT = str(ROOT / "configs" / "gpt.yaml")
COMMANDS = ("fit", "validate", "test", "predict", "estimate", "consolidate")


@dataclass
class Case:
    name: str
    args: list[str]  # "{tmp}": the case's directory; "{ckpt}": its copy of the checkpoint
    message: str  # a distinctive part of the one line
    files: dict[str, str] = field(default_factory=dict)  # written into {tmp} first
    damage: Callable[[Path], None] | None = None  # applied to {ckpt}

    def __str__(self) -> str:
        return self.name


def fit_args(*args: str) -> list[str]:
    # a small data set: the cases that get as far as building the data module need not wait for 4096 samples
    return ["fit", "--config", GPT, "--trainer.default_root_dir={tmp}", "--data.init_args.num_train=64", *args]


# --- running a case ---------------------------------------------------------------------------------------
def capture_runs(monkeypatch) -> list:
    """The CLIs whose subcommand would have run (training, validating, ...): the bad cases must stop before.
    (Each test file's ``ran`` fixture.)"""
    calls: list = []
    monkeypatch.setattr(ZeroCLI, "_run_subcommand", lambda cli, subcommand: calls.append(cli))
    monkeypatch.setattr(sys, "argv", ["lightning-zero"])  # as the console script without arguments sees it
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    return calls


def prepare(case: Case, tmp: Path, checkpoint: Path | None) -> list[str]:
    for name, text in case.files.items():
        (tmp / name).write_bytes(text.encode(errors="surrogateescape"))
    ckpt = tmp / "run.ckpt"
    if checkpoint is not None:
        shutil.copytree(checkpoint, ckpt)
        if case.damage:
            case.damage(ckpt)
    return [arg.format(tmp=tmp, ckpt=ckpt) for arg in case.args]


def one_line_error(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def check_case(case: Case, tmp: Path, checkpoint: Path | None, capsys, ran: list) -> None:
    args = prepare(case, tmp, checkpoint)
    before = snapshot_files(tmp)
    err = one_line_error(args, capsys)
    prog = f"lightning-zero {args[0]}" if args[0] in COMMANDS else "lightning-zero"
    assert err.startswith(f"{prog}: error: "), err
    assert case.message.format(tmp=tmp) in err, err
    assert snapshot_files(tmp) == before, "a file was written or deleted"
    assert ran == [] and not torch.distributed.is_initialized()
