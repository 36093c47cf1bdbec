"""The examples run as the README shows them: the fine-tuning one (its models match a single process in
tests/dist/test_hf.py) and the plain torchrun script (its engine matches one in tests/dist/test_fabric.py)."""

from __future__ import annotations

from tests.support.docs import snippet_command
from tests.support.helpers import REPO


def test_the_fine_tuning_example_runs(tmp_path):
    """README's example: a LoRA fine-tune of a Llama under zero3 on 2 CPU processes (as a user runs it)."""
    import subprocess
    import sys

    script = REPO / "examples" / "finetune_hf.py"
    result = subprocess.run(
        [sys.executable, str(script), "--devices", "2", "--steps", "4"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "frozen 623,744 and trainable 14,336 parameters; rank 0 holds parameters" in result.stdout


def test_the_torchrun_example_runs(tmp_path):
    """README's plain PyTorch script under torchrun (2 processes, zero3): the loss falls, and its checkpoint
    loads into a fresh engine with the same weights."""
    import subprocess
    import sys

    program, *args = snippet_command("torchrun-example")  # the README's command, as it is
    assert program == "torchrun", program
    command = [sys.executable, "-m", "torch.distributed.run", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "world 2, zero3: loss" in result.stdout, result.stdout
    assert "checkpoint of step 30 loaded into zero3: weights equal" in result.stdout, result.stdout
