"""The ``lightning-zero`` command: Lightning's CLI (fit / validate / test / predict) with the ZeRO
strategies registered, so ``trainer.strategy: zero2`` or a ``ZeroStrategy`` with its ``ZeroConfig``
can be written in the YAML. Any LightningModule and LightningDataModule can be named by class path;
the configs in ``configs/`` train the package's GPT on its synthetic language.

``lightning-zero consolidate CKPT_DIR OUT`` turns a sharded checkpoint into a plain state dict."""

from __future__ import annotations

import argparse
import sys

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI

import lightning_zero  # noqa: F401  (registers the zero strategies)
from lightning_zero.checkpoint.consolidate import consolidate
from lightning_zero.checkpoint.format import CheckpointError


def consolidate_main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="lightning-zero consolidate",
        description="Write the plain fp32 state dict of a sharded checkpoint directory (streamed, parameter by"
        " parameter). The output loads with torch.load (or safetensors) and module.load_state_dict.",
    )
    parser.add_argument("checkpoint", help="a checkpoint directory written by the ZeRO strategies")
    parser.add_argument("output", help="the output file: .pt, or .safetensors")
    parsed = parser.parse_args(args)
    try:
        out = consolidate(parsed.checkpoint, parsed.output)
    except CheckpointError as error:
        parser.exit(2, f"lightning-zero consolidate: error: {error}\n")
    print(f"wrote {out}")


def main(args: list[str] | None = None) -> None:
    args = sys.argv[1:] if args is None else args
    if args[:1] == ["consolidate"]:
        consolidate_main(args[1:])
        return
    LightningCLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )


if __name__ == "__main__":
    main()
