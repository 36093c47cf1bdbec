"""One rank of a run the failure tests start the way launchers do (test_preemption.py): under torchrun,
or as one process per rank with the environment srun or a scheduler sets (Lightning then starts nothing).

    python resume_target.py OUT --stage S [--kill ATTEMPT:STEP ...] [--stop-at STEP] [--signal-after STEP]

Every run resumes from ``OUT/ckpts/last.ckpt`` if there is one (``ckpt_path="last"``; under SLURM,
Lightning's own hpc resume). ``--kill A:S``: in attempt A (torchrun's restart count) rank 1 kills itself
with SIGKILL when step S starts. ``--stop-at S``: rank 1 stops itself (SIGSTOP) there instead.
``--signal-after S``: every rank writes ``OUT/at-step-S.rank<r>`` after step S and slows down, so the test's
signal lands in the middle of the epoch. Rank 0 writes the final model to ``OUT/final.pt`` and each
attempt's times to ``OUT/times-<attempt>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

START = time.time()

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from tests.support.compare import final_state  # noqa: E402
from tests.support.resume_model import ResumeModule, make_trainer  # noqa: E402


class Faults(pl.Callback):
    def __init__(self, args: argparse.Namespace, out: Path, attempt: int) -> None:
        self.args, self.out, self.attempt = args, out, attempt
        self.kill_at = {int(a): int(s) for a, s in (k.split(":") for k in args.kill)}
        self.first_step: float | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.global_step
        if trainer.global_rank != 1 or batch_idx % trainer.accumulate_grad_batches:
            return
        if self.kill_at.get(self.attempt) == step:
            (self.out / f"killed-{self.attempt}").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if self.args.stop_at == step:
            (self.out / "stopped").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.first_step is None:
            self.first_step = time.time()
            if trainer.global_rank == 0:
                times = {"start": START, "first_step": self.first_step, "resumed_at": trainer.global_step}
                (self.out / f"times-{self.attempt}.json").write_text(json.dumps(times))
        if self.args.signal_after is not None and trainer.global_step >= self.args.signal_after:
            (self.out / f"at-step-{self.args.signal_after}.rank{trainer.global_rank}").touch()
            time.sleep(0.3)  # the signal arrives during the next steps, not after the run


def main(argv: list[str] | None = None) -> None:
    """One rank's run (``argv`` None: the command line; the tests' uninterrupted runs call it on the shared
    ranks, with the same model, data and settings a launch has)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--kill", nargs="*", default=[])
    parser.add_argument("--stop-at", type=int)
    parser.add_argument("--signal-after", type=int)
    parser.add_argument("--timeout", type=float, default=60)
    args = parser.parse_args(argv)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    pl.seed_everything(0)
    trainer = make_trainer(
        args.stage,
        args.world,
        args.steps,
        dirpath=args.out / "ckpts",
        callbacks=[Faults(args, args.out, attempt)],
        timeout=args.timeout,
        default_root_dir=args.out,
    )
    slurm = "SLURM_JOB_ID" in os.environ
    trainer.fit(ResumeModule(), ckpt_path=None if slurm else "last")
    state = final_state(trainer)
    if trainer.global_rank == 0:
        torch.save(state, args.out / "final.pt")


if __name__ == "__main__":
    main()
