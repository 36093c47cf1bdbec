"""What the benchmark scripts share: a quiet Trainer's arguments, writing a report, why ranks failed."""

from __future__ import annotations

from pathlib import Path

from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

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


def failure_reason(error: Exception) -> str:
    """Why ranks started by ``spawn_local_ranks`` failed, in one line: a rank's exception (its last line), the
    signal that killed a rank or its exit code, or the deadline's ``TimeoutError``."""
    if isinstance(error, ProcessExitedException):
        how = f"killed by {error.signal_name}" if error.signal_name else f"exited with code {error.exit_code}"
        return f"rank {error.error_index} {how}"
    if isinstance(error, ProcessRaisedException):
        return f"rank {error.error_index}: {error.msg.strip().splitlines()[-1]}"
    return str(error)
