"""The fine-tuning example runs as the README shows it (its models match a single process in tests/dist/test_hf.py)."""

from __future__ import annotations

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
