"""The console script: --help (with the ZeRO options), the main job's composed configs run short through
it (the real launcher: rank 1 is started by Lightning re-running the command), a DeepSpeed config
applied with --deepspeed_config, and the estimate subcommand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_zero.cli import main

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).with_name("lightning-zero")
SHORT = ["--trainer.max_steps=12", "--trainer.val_check_interval=6", "--trainer.limit_val_batches=2"]


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _help(capsys, *args: str) -> str:
    """``lightning-zero ARGS --help`` in this process (the console script itself runs in the tests below)."""
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--help"])
    assert exit_info.value.code in (0, None)
    return capsys.readouterr().out


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


@pytest.mark.parametrize(
    "configs,heading",
    [
        (["configs/gpt.yaml"], "zero2: 2 ranks, precision 32-true"),
        (
            ["configs/gpt.yaml", "configs/stage/zero3.yaml", "configs/model/tiny.yaml"],
            "zero3: 2 ranks, precision 32-true",
        ),
        (
            [
                "configs/gpt.yaml",
                "configs/stage/zero1.yaml",
                "configs/precision/16-mixed.yaml",
                "configs/model/tiny.yaml",
            ],
            "zero1: 2 ranks, precision 16-mixed",
        ),
    ],
)
def test_main_job_short_run(configs, heading, tmp_path):
    args = [arg for config in configs for arg in ("--config", config)]
    result = _run("fit", *args, *SHORT, f"--trainer.default_root_dir={tmp_path}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert heading in out
    assert "throughput:" in out and "tokens/s" in out
    assert "rank 1" in out and "formula" in out
    # A clean console: the summary ends the output (the bar's last frame comes before it), no warnings.
    assert "Epoch 0/-2" not in out and "step: 12/12" in out
    assert result.stdout.rindex("step: 12/12") < result.stdout.index(heading), result.stdout[-1500:]
    assert "Warning" not in out, out[-3000:]


def test_fit_with_a_deepspeed_config(tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                "gradient_accumulation_steps": 2,
                "gradient_clipping": 0.5,
                "train_micro_batch_size_per_gpu": 4,
            }
        )
    )
    result = _run(
        "fit",
        "--config",
        "configs/gpt.yaml",
        "--config",
        "configs/model/tiny.yaml",
        *SHORT,
        f"--deepspeed_config={ds}",
        f"--trainer.default_root_dir={tmp_path}",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "applied the DeepSpeed config" in out and "zero3: 2 ranks" in out
    saved = (tmp_path / "config.yaml").read_text()
    for line in ("accumulate_grad_batches: 2", "gradient_clip_val: 0.5", "batch_size: 4", "strategy: zero3"):
        assert line in saved, line


def test_estimate_subcommand(capsys):
    # In-process (the console script's own behaviour is covered by test_help_... and test_bad_input.py).
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
