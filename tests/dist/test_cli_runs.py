"""``lightning-zero fit`` through ``main()`` on the shared ranks (Lightning joins them as it joins the ranks a
launcher started): composed configs for another stage, model and precision, and a DeepSpeed config applied
with --deepspeed_config. Rank 0 prints the summary: the heading, the throughput and each rank's memory
against the formula. (The console script itself runs the main job in tests/e2e/test_cli.py.)"""

from __future__ import annotations

import io
import json
import logging
import sys
from contextlib import redirect_stderr, redirect_stdout

from lightning_zero.cli.main import main
from tests.support.helpers import REPO

SHORT = ["--trainer.max_steps=12", "--trainer.val_check_interval=6", "--trainer.limit_val_batches=2"]
RUNS = {  # name -> (configs, the summary's heading)
    "zero3": (["gpt.yaml", "stage/zero3.yaml", "model/tiny.yaml"], "zero3: 2 ranks, precision 32-true"),
    "zero3pp": (["gpt.yaml", "stage/zero3pp.yaml", "model/tiny.yaml"], "zero3: 2 ranks, precision 32-true"),
    "zero1-16": (
        ["gpt.yaml", "stage/zero1.yaml", "precision/16-mixed.yaml", "model/tiny.yaml"],
        "zero1: 2 ranks, precision 16-mixed",
    ),
    "deepspeed": (["gpt.yaml", "model/tiny.yaml"], "zero3: 2 ranks, precision 32-true"),
}


def _fit(rank: int, world: int, root) -> dict[str, str]:
    sys.argv[1:] = []  # as the console script without arguments sees it (main() is given them)
    printed = {}
    for name, (configs, _) in RUNS.items():
        args = [arg for config in configs for arg in ("--config", str(REPO / "configs" / config))]
        if name == "deepspeed":
            args.append(f"--deepspeed_config={root / 'ds_config.json'}")
        if name == "zero3pp":  # the 2 ranks as 2 nodes of 1
            args.append("--zero.node_size=1")
        if name == "zero3":  # (the engine's activation checkpointing, and the GPT sequence-parallel over both ranks)
            args += ["--zero.activation_checkpointing=selective", "--zero.offload_activations=cpu"]
            args += ["--zero.sequence_parallel_size=2"]
        out = io.StringIO()
        logged = logging.StreamHandler(out)  # Lightning's rank_zero_info lines
        logging.getLogger("lightning.pytorch").addHandler(logged)
        try:
            with redirect_stdout(out), redirect_stderr(out):
                main(["fit", *args, *SHORT, f"--trainer.default_root_dir={root / name}"])
        finally:
            logging.getLogger("lightning.pytorch").removeHandler(logged)
        printed[name] = out.getvalue()
    return printed


def test_composed_configs_and_a_deepspeed_config(ranks, tmp_path):
    ds = {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "train_micro_batch_size_per_gpu": 4,
    }
    (tmp_path / "ds_config.json").write_text(json.dumps(ds))
    printed, _ = ranks(_fit, 2, tmp_path)
    for name, (_, heading) in RUNS.items():
        out = printed[name]
        assert heading in out, out[-3000:]
        assert "throughput:" in out and "tokens/s" in out
        assert "rank 1" in out and "formula" in out
    assert "applied the DeepSpeed config" in printed["deepspeed"]
    saved = (tmp_path / "zero3" / "config.yaml").read_text()
    assert "activation_checkpointing: selective" in saved and "offload_activations: cpu" in saved
    assert "sequence_parallel_size: 2" in saved
    saved = (tmp_path / "deepspeed" / "config.yaml").read_text()
    for line in ("accumulate_grad_batches: 2", "gradient_clip_val: 0.5", "batch_size: 4", "strategy: zero3"):
        assert line in saved, line
