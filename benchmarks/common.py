"""What the benchmark scripts share: a quiet Trainer's arguments and writing a report."""

from __future__ import annotations

from pathlib import Path

# A Trainer that only trains: no validation, logger, checkpoints, progress bar or model summary.
QUIET = {
    "limit_val_batches": 0,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def emit(report: str, out: Path | None) -> None:
    """Prints the Markdown ``report`` and, with ``out``, writes it there too."""
    print(report)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report)
