"""The CLI in this process: --help (with the ZeRO options) and the estimate subcommand. (Training runs through
``main()`` on the shared ranks, tests/dist/test_cli_runs.py; the console script itself, tests/e2e.)"""

from __future__ import annotations

import pytest

from lightning_zero.cli.main import main
from tests.support.helpers import run_cli


def _help(capsys, *args: str) -> str:
    code, out, _ = run_cli(capsys, *args, "--help")
    assert code == 0
    return out


def test_help_lists_the_subcommands_and_documents_the_zero_options(capsys):
    top = _help(capsys)
    for sub in ("fit", "validate", "test", "predict", "estimate", "consolidate"):
        assert sub in top
    fit_help = _help(capsys, "fit")
    for option in (
        "--zero.reduce_bucket_size",
        "--zero.overlap_comm",
        "--zero.max_live_parameters",
        "--deepspeed_config",
    ):
        assert option in fit_help
    assert "elements per gradient bucket" in fit_help  # the field's documentation


def test_estimate_subcommand(capsys):
    main(
        ["estimate", "--params", "1.3e9", "--devices", "8", "--nodes", "2", "--precision", "16-mixed"]
        + ["--device-memory", "20GB"]
    )
    stdout = capsys.readouterr().out
    lines: dict[str, list[str]] = {}  # the memory table's rows (the traffic table's follow, with the same names)
    for line in stdout.splitlines():
        if line.startswith(("ddp", "zero")):
            lines.setdefault(line.split()[0], line.split()[1:])
    psi, n, gib = 1.3e9, 16, 2**30
    assert float(lines["zero2"][3]) == pytest.approx((2 * psi + 14 * psi / n) / gib, rel=1e-3)
    assert float(lines["zero3"][3]) == pytest.approx(16 * psi / n / gib, rel=1e-3)
    assert lines["ddp"][-1] == "no" and lines["zero1"][-1] == "yes"
    assert "the smallest configuration that fits: zero1" in stdout
